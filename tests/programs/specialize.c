/* Semi-invariants planted for `specialize` (goal-directed value profiling).
 *
 * bucket_sum(a, n, div): div is 16 on 97% of the calls, something else (3..98) otherwise; the loop
 * divides by it (a `div` with the divisor in a register: knowing div makes it a shift).
 * scaled(a, n, mode): mode is 2 on 99% of the calls; the loop tests it on every trip (gcc -O2 does
 * not unswitch loops), so knowing mode removes the compares and branches from the loop.
 * With the argument "spec", main calls the versions specialized by hand at the reported points
 * (bench/specialize.py measures the speedup against the saving `specialize` predicts).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static unsigned long long rng_state = 88172645463325252ULL;
static unsigned long next_rand(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (unsigned long)rng_state;
}

#define N 256
unsigned *data;
volatile unsigned long sink;

__attribute__((noinline)) unsigned long bucket_sum(const unsigned *a, long n, unsigned div) {
    unsigned long s = 0;
    for (long i = 0; i < n; i++) s += a[i] / div;
    return s;
}

__attribute__((noinline)) unsigned long scaled(const unsigned *a, long n, int mode) {
    unsigned long s = 0;
    for (long i = 0; i < n; i++) {
        unsigned x = a[i];
        if (mode == 0) s += x;
        else if (mode == 1) s += x * 3;
        else if (mode == 2) s += x >> 1;
        else s -= x;
    }
    return s;
}

__attribute__((noinline)) unsigned long bucket_sum_spec(const unsigned *a, long n, unsigned div) {
    if (div != 16) return bucket_sum(a, n, div);
    unsigned long s = 0;
    for (long i = 0; i < n; i++) s += a[i] / 16;
    return s;
}

__attribute__((noinline)) unsigned long scaled_spec(const unsigned *a, long n, int mode) {
    if (mode != 2) return scaled(a, n, mode);
    unsigned long s = 0;
    for (long i = 0; i < n; i++) s += a[i] >> 1;
    return s;
}

int main(int argc, char **argv) {
    long rounds = argc > 1 ? atol(argv[1]) : 200000;
    int spec = argc > 2 && strcmp(argv[2], "spec") == 0;
    /* elements per call (default N): with many, the calls are few enough for `record --goal` to
       probe both functions' entries at every execution */
    long n = argc > 3 ? atol(argv[3]) : N;
    if (n < 1) n = N;
    data = malloc(n * sizeof *data);
    if (!data) return 1;
    for (long i = 0; i < n; i++) data[i] = (unsigned)next_rand();
    for (long r = 0; r < rounds; r++) {
        unsigned long u = next_rand() % 100;
        unsigned div = u < 97 ? 16 : 3 + (unsigned)(next_rand() % 96);
        int mode = u == 0 ? 1 : 2;
        if (spec) {
            sink += bucket_sum_spec(data, n, div);
            sink += scaled_spec(data, n, mode);
        } else {
            sink += bucket_sum(data, n, div);
            sink += scaled(data, n, mode);
        }
    }
    printf("%lu\n", (unsigned long)sink);
    return 0;
}
