/* kvlab's batch copy for host memory: every run of a copy plan in one call, the bytes
 * split evenly over a few threads (the CPU counterpart of cudaMemcpyBatchAsync). Python
 * calls it through ctypes, which releases the GIL for the whole copy. */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define MAX_THREADS 64
#define MIN_SHARE (256 << 10) /* bytes: below this another thread costs more than it saves */

typedef struct {
    const int64_t *src, *dst, *len;
    int64_t count, begin, end; /* this thread's bytes, counted over the runs in order */
} share_t;

static void *copy_share(void *arg) {
    const share_t *s = arg;
    int64_t at = 0; /* bytes before run i */
    for (int64_t i = 0; i < s->count && at < s->end; at += s->len[i], i++) {
        int64_t lo = at > s->begin ? at : s->begin;
        int64_t hi = at + s->len[i] < s->end ? at + s->len[i] : s->end;
        if (hi > lo)
            memcpy((char *)(intptr_t)s->dst[i] + (lo - at), (const char *)(intptr_t)s->src[i] + (lo - at),
                   (size_t)(hi - lo));
    }
    return NULL;
}

/* Copy len[i] bytes from address src[i] to dst[i] for every i < count, on up to
 * `threads` threads (the caller's included). Returns 0, or -1 if a thread could not start
 * (its share is then copied by the caller). */
int kvlab_copy_runs(const int64_t *src, const int64_t *dst, const int64_t *len, int64_t count, int threads) {
    int64_t total = 0;
    for (int64_t i = 0; i < count; i++)
        total += len[i];
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    if (threads > total / MIN_SHARE)
        threads = (int)(total / MIN_SHARE);
    if (threads < 1)
        threads = 1;
    share_t shares[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0}, status = 0;
    for (int t = 0; t < threads; t++)
        shares[t] = (share_t){src, dst, len, count, total * t / threads, total * (t + 1) / threads};
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&ids[t], NULL, copy_share, &shares[t]) == 0;
    copy_share(&shares[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) {
            pthread_join(ids[t], NULL);
        } else {
            copy_share(&shares[t]);
            status = -1;
        }
    }
    return status;
}
