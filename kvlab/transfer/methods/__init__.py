"""The copy methods, one module each: importing this package registers every one of them
(a new module here is found without editing anything else)."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
