/* A CPU-bound benchmark workload that reports its own CPU time.
 *
 * Usage: workload SECONDS_OF_WORK   (calibrated work, not a timer: the same
 * amount of computation whatever the profiler does to it)
 * Prints: "cpu_ns <user+sys of this process> user_ns <user> result <x>"
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>

static uint64_t mix(uint64_t x) { x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; return x; }

__attribute__((noinline)) uint64_t kernel_a(uint64_t n, uint64_t s) {
    for (uint64_t i = 0; i < n; i++) s = mix(s + i);
    return s;
}

__attribute__((noinline)) uint64_t kernel_b(uint64_t n, uint64_t s) {
    static uint32_t table[4096];
    for (uint64_t i = 0; i < n; i++) { uint32_t k = (uint32_t)(s >> 20) & 4095; table[k] += (uint32_t)i; s = s * 31 + table[k]; }
    return s;
}

int main(int argc, char **argv) {
    double secs = argc > 1 ? atof(argv[1]) : 5.0;
    uint64_t n = (uint64_t)(secs * 1.95e8);  /* about one second of work per unit here */
    uint64_t s = 1;
    for (int r = 0; r < 10; r++) { s = kernel_a(n / 10, s); s = kernel_b(n / 10, s); }
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    long long u = ru.ru_utime.tv_sec * 1000000000LL + ru.ru_utime.tv_usec * 1000LL;
    long long k = ru.ru_stime.tv_sec * 1000000000LL + ru.ru_stime.tv_usec * 1000LL;
    printf("cpu_ns %lld user_ns %lld result %llu\n", u + k, u, (unsigned long long)s);
    return 0;
}
