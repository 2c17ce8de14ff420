#include <immintrin.h>
#include <string.h>
#include <stddef.h>
void copy_nt(void *dst, const void *src, size_t n) {  /* dst 32-aligned, n multiple of 128 */
    __m256i *d = dst; const __m256i *s = src;
    for (size_t i = 0; i < n / 32; i += 4) {
        __m256i a = _mm256_loadu_si256(s + i), b = _mm256_loadu_si256(s + i + 1), c = _mm256_loadu_si256(s + i + 2), e = _mm256_loadu_si256(s + i + 3);
        _mm256_stream_si256(d + i, a); _mm256_stream_si256(d + i + 1, b); _mm256_stream_si256(d + i + 2, c); _mm256_stream_si256(d + i + 3, e);
    }
    _mm_sfence();
}
void copy_plain(void *dst, const void *src, size_t n) { memcpy(dst, src, n); }
void copy_prefetchw(void *dst, const void *src, size_t n) {  /* prefetchw the destination ahead, then memcpy in 4K steps */
    char *d = dst; const char *s = src;
    for (size_t o = 0; o < n; o += 4096) {
        size_t m = n - o < 4096 ? n - o : 4096;
        for (size_t p = o + 4096; p < o + 8192 && p < n; p += 64) __builtin_prefetch(d + p, 1, 3);
        memcpy(d + o, s + o, m);
    }
}
