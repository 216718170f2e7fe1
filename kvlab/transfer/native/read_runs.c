/* kvlab's checked file reads: a stored chunk's bytes read from its file straight into the
 * runs of a paged cache (preadv: the kernel copies from the page cache, no buffer between
 * and no page of a new mapping to fault in), each batch checksummed with CRC32C while it
 * is still in the core's cache. Python calls these through ctypes, which releases the GIL,
 * so the worker's fetch threads checksum side by side. CRC32C is the iSCSI polynomial
 * google_crc32c computes: the same value for the same bytes. Hardware CRC (SSE4.2) only. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>

#define POLY 0x82f63b78u    /* CRC32C, reflected */
#define MAX_IOV 1024
#define BATCH (256 << 10)   /* bytes read before they are checksummed: they stay in L2 */

/* a * b modulo the polynomial (reflected bit order): how a CRC register moves over zeros */
static uint32_t multmodp(uint32_t a, uint32_t b) {
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0)
                break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ POLY : b >> 1;
    }
    return p;
}

/* x^(8n) modulo the polynomial: multiplying a register by it moves it over n zero bytes */
static uint32_t shift_bytes(uint64_t n) {
    uint32_t power = 1u << 23, p = 1u << 31; /* x^8, x^0 */
    for (; n; n >>= 1) {
        if (n & 1)
            p = multmodp(power, p);
        power = multmodp(power, power);
    }
    return p;
}

#if defined(__x86_64__)
#include <nmmintrin.h>

static uint64_t load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* The CRC register (no pre- or post-inversion) over n bytes: three streams at once, since
 * one crc32 instruction waits for the last (3 cycles each), then joined by shifting. */
__attribute__((target("sse4.2"))) static uint32_t crc_raw(uint32_t c, const uint8_t *p, uint64_t n) {
    static __thread uint64_t cached_lane;
    static __thread uint32_t cached_shift;
    while (n && ((uintptr_t)p & 7)) {
        c = _mm_crc32_u8(c, *p++);
        n--;
    }
    uint64_t lane = (n / 3) & ~(uint64_t)7;
    if (lane > 8192)
        lane = 8192;
    if (lane >= 256) {
        if (lane != cached_lane) {
            cached_lane = lane;
            cached_shift = shift_bytes(lane);
        }
        while (n >= 3 * lane) {
            uint64_t c0 = c, c1 = 0, c2 = 0;
            for (uint64_t i = 0; i < lane; i += 8) {
                c0 = _mm_crc32_u64(c0, load64(p + i));
                c1 = _mm_crc32_u64(c1, load64(p + lane + i));
                c2 = _mm_crc32_u64(c2, load64(p + 2 * lane + i));
            }
            c = multmodp(cached_shift, (uint32_t)c0) ^ (uint32_t)c1;
            c = multmodp(cached_shift, c) ^ (uint32_t)c2;
            p += 3 * lane;
            n -= 3 * lane;
        }
    }
    for (; n >= 8; p += 8, n -= 8)
        c = (uint32_t)_mm_crc32_u64(c, load64(p));
    while (n--)
        c = _mm_crc32_u8(c, *p++);
    return c;
}

int kvlab_crc32c_hardware(void) { return __builtin_cpu_supports("sse4.2"); }
#else
static uint32_t crc_raw(uint32_t c, const uint8_t *p, uint64_t n) { /* unused: no hardware CRC */
    (void)p;
    (void)n;
    return c;
}

int kvlab_crc32c_hardware(void) { return 0; }
#endif

/* CRC32C of the runs' bytes in order, extending crc (0 to start) */
uint32_t kvlab_crc32c(uint32_t crc, const int64_t *addr, const int64_t *len, int64_t count) {
    uint32_t c = ~crc;
    for (int64_t i = 0; i < count; i++)
        c = crc_raw(c, (const uint8_t *)(intptr_t)addr[i], (uint64_t)len[i]);
    return ~c;
}

/* Read the file's bytes from `offset` on into the runs addr[i]/len[i] in order, and extend
 * *crc over them (crc NULL: nothing summed, what the reads alone cost, for profiles). A run
 * at `scratch` is a place for bytes that are only checksummed: a batch ends after it, so the
 * next one there is read after this one was summed. 0, or an errno (ENODATA: the file ended
 * first). */
int kvlab_read_runs(int fd, int64_t offset, const int64_t *addr, const int64_t *len, int64_t count, int64_t scratch,
                    uint32_t *crc) {
    struct iovec iov[MAX_IOV];
    uint32_t c = crc ? ~*crc : 0;
    int64_t i = 0;
    while (i < count) {
        int n = 0;
        int64_t bytes = 0, first = i;
        while (i < count && n < MAX_IOV && bytes < BATCH) {
            iov[n].iov_base = (void *)(intptr_t)addr[i];
            iov[n].iov_len = (size_t)len[i];
            bytes += len[i];
            n++;
            if (addr[i++] == scratch)
                break;
        }
        struct iovec *at = iov;
        int left = n;
        int64_t want = bytes;
        while (want > 0) { /* a short read goes on where it stopped */
            ssize_t got = preadv(fd, at, left, offset);
            if (got < 0 && errno == EINTR)
                continue;
            if (got < 0)
                return errno;
            if (got == 0)
                return ENODATA;
            offset += got;
            want -= got;
            while (left && (size_t)got >= at->iov_len) {
                got -= (ssize_t)at->iov_len;
                at++;
                left--;
            }
            if (left) {
                at->iov_base = (char *)at->iov_base + got;
                at->iov_len -= (size_t)got;
            }
        }
        for (int64_t j = first; crc && j < i; j++)
            c = crc_raw(c, (const uint8_t *)(intptr_t)addr[j], (uint64_t)len[j]);
    }
    if (crc)
        *crc = ~c;
    return 0;
}
