// The peaks scripts/roofline.py holds prefill against: per thread, int8 multiply-adds per second through
// AVX-512 VNNI (vpdpbusd, the instruction the Q4_1 kernels sum with) and f32 multiply-adds through FMA
// (attention's dot products); and read bandwidth over a buffer larger than the caches. Each kernel runs
// on T threads at once (argv[1]) and prints one line: name, total ops per second, over all threads.
//
//     cc -O2 -march=native -pthread scripts/roofline.c -o /tmp/roofline && /tmp/roofline 2

#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define ACCS 12  // independent accumulators: more than latency x throughput, so the ports are the limit

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static volatile float sink;

#if defined(__AVX512VNNI__)
static void * vnni(void * arg) {
    const long iters = *(const long *) arg;
    __m512i acc[ACCS];
#pragma GCC unroll 12
    for (int i = 0; i < ACCS; ++i) acc[i] = _mm512_set1_epi32(i);
    const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
    for (long n = 0; n < iters; ++n) {
#pragma GCC unroll 12
        for (int i = 0; i < ACCS; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
        __asm__ volatile("" : "+v"(acc[0]), "+v"(acc[1]), "+v"(acc[2]), "+v"(acc[3]), "+v"(acc[4]), "+v"(acc[5]),
                         "+v"(acc[6]), "+v"(acc[7]), "+v"(acc[8]), "+v"(acc[9]), "+v"(acc[10]), "+v"(acc[11]));
    }
    int32_t out[16];
    _mm512_storeu_si512(out, acc[0]);
    sink = (float) out[0];
    return NULL;
}
#endif

static void * fma32(void * arg) {
    const long iters = *(const long *) arg;
#if defined(__AVX512F__)
    __m512 acc[ACCS];
#pragma GCC unroll 12
    for (int i = 0; i < ACCS; ++i) acc[i] = _mm512_set1_ps((float) i);
    const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
    for (long n = 0; n < iters; ++n) {
#pragma GCC unroll 12
        for (int i = 0; i < ACCS; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
        __asm__ volatile("" : "+v"(acc[0]), "+v"(acc[1]), "+v"(acc[2]), "+v"(acc[3]), "+v"(acc[4]), "+v"(acc[5]),
                         "+v"(acc[6]), "+v"(acc[7]), "+v"(acc[8]), "+v"(acc[9]), "+v"(acc[10]), "+v"(acc[11]));
    }
    sink = _mm512_reduce_add_ps(acc[0]);
#else
    __m256 acc[ACCS];
#pragma GCC unroll 12
    for (int i = 0; i < ACCS; ++i) acc[i] = _mm256_set1_ps((float) i);
    const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
    for (long n = 0; n < iters; ++n) {
#pragma GCC unroll 12
        for (int i = 0; i < ACCS; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
        __asm__ volatile("" : "+v"(acc[0]), "+v"(acc[1]), "+v"(acc[2]), "+v"(acc[3]), "+v"(acc[4]), "+v"(acc[5]),
                         "+v"(acc[6]), "+v"(acc[7]), "+v"(acc[8]), "+v"(acc[9]), "+v"(acc[10]), "+v"(acc[11]));
    }
    float out[8];
    _mm256_storeu_ps(out, acc[0]);
    sink = out[0];
#endif
    return NULL;
}

#define STREAM_BYTES (256L << 20)  // per thread: past any last-level cache
#define STREAM_PASSES 8

static __m256i * buffers[64];
static int next_buffer;

static void * stream(void * arg) {
    const __m256i * p = buffers[__atomic_fetch_add(&next_buffer, 1, __ATOMIC_RELAXED)];
    (void) arg;
    __m256i s = _mm256_setzero_si256();
    for (long n = 0; n < STREAM_PASSES; ++n) {
        for (long i = 0; i < STREAM_BYTES / 32; i += 4) {
            s = _mm256_add_epi32(s, _mm256_add_epi32(_mm256_add_epi32(p[i], p[i + 1]),
                                                     _mm256_add_epi32(p[i + 2], p[i + 3])));
        }
    }
    sink = (float) _mm256_extract_epi32(s, 0);
    return NULL;
}

// runs `body` on `threads` threads and returns the seconds the slowest took
static double run(void * (*body)(void *), long work, int threads) {
    pthread_t t[64];
    const double start = now();
    for (int i = 0; i < threads; ++i) pthread_create(&t[i], NULL, body, &work);
    for (int i = 0; i < threads; ++i) pthread_join(t[i], NULL);
    return now() - start;
}

int main(int argc, char ** argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : 1;
    const long iters = 50L * 1000 * 1000;
#if defined(__AVX512VNNI__)
    run(vnni, iters / 10, threads);  // warm the clocks
    printf("vnni_int8_macs %.4g\n", (double) iters * ACCS * 64 * threads / run(vnni, iters, threads));
#endif
    const int lanes =
#if defined(__AVX512F__)
        16;
#else
        8;
#endif
    printf("fma_f32_macs %.4g\n", (double) iters * ACCS * lanes * threads / run(fma32, iters, threads));
    for (int i = 0; i < threads; ++i) {  // written before the clock starts (the first touch maps the pages)
        buffers[i] = aligned_alloc(64, STREAM_BYTES);
        memset(buffers[i], 1, STREAM_BYTES);
    }
    printf("read_bytes %.4g\n", (double) STREAM_BYTES * STREAM_PASSES * threads / run(stream, 0, threads));
    return 0;
}
