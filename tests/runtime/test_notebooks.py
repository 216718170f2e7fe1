"""The notebook runner names the notebooks it knows."""

import os
from pathlib import Path

import pytest

from kvlab.runtime.notebooks import notebook_paths


def test_unknown_notebook():
    with pytest.raises(ValueError, match="no notebook"):
        notebook_paths(["99_nothing"])


def test_last_duration_only_from_a_run_of_the_same_kind(tmp_path):
    """The per-notebook estimate comes from the last run made the same way, else none."""
    import json

    from kvlab.runtime.notebooks import last_duration

    executed = tmp_path / "02.ipynb"
    assert last_duration(executed, profile="paper", measure=True) is None  # never ran
    executed.write_text(json.dumps({"metadata": {"papermill": {"duration": 90.0,
                                                                "parameters": {"profile": "paper", "measure": True}}}}))
    assert last_duration(executed, profile="paper", measure=True) == 90.0
    assert last_duration(executed, profile="quick", measure=True) is None
    assert last_duration(executed, profile="paper", measure=False) is None
    executed.write_text("not json")
    assert last_duration(executed, profile="paper", measure=True) is None


def test_an_unknown_profile_is_refused_before_anything_runs(tmp_path):
    from kvlab.runtime.notebooks import run_notebooks

    with pytest.raises(ValueError, match=r"unknown profile 'fast'; choose from \['quick', 'standard', 'paper'\]"):
        run_notebooks(profile="fast", out=tmp_path)
    assert not list(tmp_path.iterdir())


def test_run_records_name_their_profile(tmp_path, monkeypatch):
    """A result says which profile measured it; one measured outside the notebooks says adhoc."""
    import json

    from kvlab.results import load_results, record_run, use_profile

    monkeypatch.delenv("KVLAB_PROFILE", raising=False)
    path = tmp_path / "x-cpu.jsonl"
    record_run(path, [{"value": 1}], "cpu")
    run = json.loads(path.read_text().splitlines()[0])
    assert run["profile"] == "adhoc" and load_results([path])[0]["profile"] == "adhoc"
    use_profile("standard")
    record_run(path, [{"value": 2}], "cpu")
    (row,) = load_results([path])
    assert row["value"] == 2 and row["profile"] == "standard"


def test_only_the_parameters_a_notebook_declares_are_passed():
    from kvlab.runtime.notebooks import declared_only

    atlas, timing = notebook_paths(["01_kv_layouts", "02_transfer_timing"])
    given = {"profile": "quick", "measure": False, "nonsense": 1}
    assert declared_only(atlas, given) == {"profile": "quick"}  # notebook 01 times nothing
    assert declared_only(timing, given) == {"profile": "quick", "measure": False}


def test_every_committed_run_record_names_its_profile():
    """The README's promise, on the files the figures are drawn from."""
    import json

    from conftest import committed_data

    unnamed = [(path.name, number) for path in sorted((committed_data() / "results").glob("*.jsonl"))
               for number, line in enumerate(path.read_text().splitlines(), 1)
               if line.strip() and json.loads(line).get("record") == "run" and not json.loads(line).get("profile")]
    assert not unnamed, f"run records without a profile: {unnamed}"


@pytest.mark.parametrize(("name", "measure", "measured_now"), [
    ("quick", True, {"fast"}),
    ("standard", True, {"fast", "engine"}),
    ("paper", True, {"fast", "engine", "slow"}),
    ("paper", False, set()),
])
def test_a_profile_measures_what_it_can_afford_and_reads_the_rest(tmp_path, monkeypatch, name, measure, measured_now):
    """quick (the tests) times only the fast sections; standard runs the engines too; paper
    everything; measure=False nothing. What a profile does not measure comes from the
    results at hand (fast sections) or the committed ones (engine and slow sections)."""
    from kvlab.results import Profile, record_run

    here, committed = tmp_path / "here", tmp_path / "committed"
    monkeypatch.setenv("KVLAB_COMMITTED_RESULTS", str(committed))
    monkeypatch.delenv("KVLAB_PROFILE", raising=False)
    for folder, value in ((here, "at hand"), (committed, "committed")):
        for cost in ("fast", "engine", "slow"):
            record_run(folder / f"{cost}-cpu.jsonl", [{"value": value}], "cpu")
    run = Profile(name, measure, here)
    assert os.environ["KVLAB_PROFILE"] == name, "what it measures records the profile"
    seen = {cost: run.rows(cost, lambda: [{"value": "now"}], cost)[0]["value"] for cost in ("fast", "engine", "slow")}
    assert {cost for cost, value in seen.items() if value == "now"} == measured_now
    assert seen["fast"] in ("now", "at hand")
    assert all(seen[cost] in ("now", "committed") for cost in ("engine", "slow"))
    assert run.pick(quick=1, standard=2, paper=3) == {"quick": 1, "standard": 2, "paper": 3}[name]


def test_a_profile_names_its_choices():
    from kvlab.results import Profile

    with pytest.raises(ValueError, match=r"unknown profile 'fast'"):
        Profile("fast")
    with pytest.raises(ValueError, match=r"unknown cost 'huge'; choose from \['fast', 'engine', 'slow'\]"):
        Profile("quick").measures("huge")


def test_the_parameters_cell_shows_the_values_a_run_gives(tmp_path):
    """The executed copy keeps one parameters cell, with the values it ran with in place of the
    defaults and each line's comment kept (papermill would add a second cell after it); papermill's
    record of them stays for the report and `make run`'s estimates."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    from kvlab.runtime.notebooks import parameterized

    (timing,) = notebook_paths(["02_transfer_timing"])
    notebook = parameterized(timing, {"profile": "quick", "measure": False, "figures_dir": "out/figures"})
    (cell,) = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
    assert 'profile = "quick"  # quick (the tests)' in cell.source and "measure = False  # False:" in cell.source
    assert 'figures_dir = "out/figures"' in cell.source and 'results_dir = "../data/results"' in cell.source
    assert notebook.metadata["papermill"]["parameters"] == {"profile": "quick", "measure": False,
                                                            "figures_dir": "out/figures"}
    assert not [c for c in notebook.cells if "injected-parameters" in c.metadata.get("tags", [])]
    tuple_cell = tmp_path / "tuple.ipynb"
    nbformat.write(new_notebook(cells=[new_code_cell('profile, measure = "standard", True',
                                                     metadata={"tags": ["parameters"]})]), tuple_cell)
    with pytest.raises(ValueError, match=r"sets \['profile'\] other than as one line each"):
        parameterized(tuple_cell, {"profile": "quick"})
    assert parameterized(tuple_cell, {}).cells[0].source == (
        'profile, measure = "standard", True')


def test_every_notebook_names_the_stems_of_its_results_and_figures():
    """The notebooks are numbered as a course, their results and figures keep the stems papers
    cite: each notebook but the solutions names its prefix."""
    from kvlab.runtime.notebooks import DATA_PREFIX, SOLUTIONS

    assert sorted([*DATA_PREFIX, SOLUTIONS]) == [path.stem for path in notebook_paths()]


def test_the_solutions_read_the_results_as_git_holds_them(tmp_path, monkeypatch):
    """What `make run` appended on this machine (a quick run's tiny model) is not an answer:
    the CLI runs the solutions notebook with $KVLAB_COMMITTED_RESULTS at HEAD's data/results."""
    import subprocess

    import kvlab.results
    from kvlab.results import COMMITTED_RESULTS_ENV, committed_as_in_git
    from kvlab.runtime.processes import environment

    results = tmp_path / "data" / "results"
    results.mkdir(parents=True)
    (results / "03_timeline-x.jsonl").write_text("committed\n")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "results"], check=True)
    (results / "03_timeline-x.jsonl").write_text("committed\nappended by make run\n")
    (results / "03_timeline-here.jsonl").write_text("this machine's run\n")
    monkeypatch.delenv(COMMITTED_RESULTS_ENV, raising=False)
    monkeypatch.setattr(kvlab.results, "committed_results_dir", lambda: results)
    with committed_as_in_git() as env, environment(env):
        copy = Path(os.environ[COMMITTED_RESULTS_ENV])
        assert sorted(p.name for p in copy.iterdir()) == ["03_timeline-x.jsonl"]
        assert (copy / "03_timeline-x.jsonl").read_text() == "committed\n"
    assert COMMITTED_RESULTS_ENV not in os.environ and not copy.exists()
    monkeypatch.setenv(COMMITTED_RESULTS_ENV, "/the/tests/copy")  # already set: left as it is
    with committed_as_in_git() as env:
        assert env == {}
