/* kvlab's batch copy for host memory: every run of a copy plan in one call, the bytes
 * split evenly over a few threads (the CPU counterpart of cudaMemcpyBatchAsync). Python
 * calls it through ctypes, which releases the GIL for the whole copy.
 *
 * A batch larger than the last-level cache is written with streaming (non-temporal) stores:
 * its destination cannot stay cached anyway, and a plain store first reads each line it
 * writes, so a copy moves three bytes per byte where streaming moves two. glibc's memcpy
 * streams only a single call beyond its own threshold, never a batch of smaller runs. */
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__) /* every x86-64; elsewhere (an Arm host) plain memcpy throughout */
#include <emmintrin.h>
#define STREAMING 1
#else
#define STREAMING 0
#endif

#define MAX_THREADS 64
#define MIN_SHARE (256 << 10) /* bytes: below this another thread costs more than it saves */

typedef struct {
    const int64_t *src, *dst, *len;
    int64_t count, begin, end; /* this thread's bytes, counted over the runs in order */
    int streaming;
} share_t;

/* memcpy with streaming stores: plain copies up to the destination's first 16-byte boundary
 * and of the last partial 64 bytes, streaming stores of whole 64-byte lines between. */
static void copy_streaming(char *dst, const char *src, size_t n) {
#if STREAMING
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src), b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32)), d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
#endif
    memcpy(dst, src, n);
}

static void *copy_share(void *arg) {
    const share_t *s = arg;
    int64_t at = 0; /* bytes before run i */
    for (int64_t i = 0; i < s->count && at < s->end; at += s->len[i], i++) {
        int64_t lo = at > s->begin ? at : s->begin;
        int64_t hi = at + s->len[i] < s->end ? at + s->len[i] : s->end;
        char *to = (char *)(intptr_t)s->dst[i] + (lo - at);
        const char *from = (const char *)(intptr_t)s->src[i] + (lo - at);
        if (hi > lo) {
            if (s->streaming)
                copy_streaming(to, from, (size_t)(hi - lo));
            else
                memcpy(to, from, (size_t)(hi - lo));
        }
    }
#if STREAMING
    if (s->streaming)
        _mm_sfence(); /* the streamed lines are visible before the thread reports done */
#endif
    return NULL;
}

/* Copy len[i] bytes from address src[i] to dst[i] for every i < count, on up to
 * `threads` threads (the caller's included), with streaming stores when the runs add up to
 * `streaming_from` bytes or more (0: never). Returns 0, or -1 if a thread could not start
 * (its share is then copied by the caller). */
int kvlab_copy_runs(const int64_t *src, const int64_t *dst, const int64_t *len, int64_t count, int threads,
                    int64_t streaming_from) {
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
        shares[t] = (share_t){src, dst, len, count, total * t / threads, total * (t + 1) / threads,
                              streaming_from > 0 && total >= streaming_from};
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
