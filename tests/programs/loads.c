/* A load to avoid, planted for `specialize` (goal-directed value profiling, load avoidance): the
 * loop adds to *p and reads *q on every trip; gcc -O2 must load *q again after each store to *p,
 * since the two may be the same. They are on 95% of the calls, so the load could take what the
 * store wrote. Arguments: calls (default 2,000,000), trips per call (default 64).
 */
#include <stdio.h>
#include <stdlib.h>

volatile long sink;
static unsigned long long st = 88172645463325252ULL;
static unsigned long nr(void) {
    st ^= st << 13;
    st ^= st >> 7;
    st ^= st << 17;
    return (unsigned long)st;
}

__attribute__((noinline)) long accumulate(long *p, const long *q, long n) {
    long s = 0;
    for (long i = 0; i < n; i++) {
        p[1] += i;
        s += q[1] * 3;
    }
    return s;
}

int main(int argc, char **argv) {
    long rounds = argc > 1 ? atol(argv[1]) : 2000000, n = argc > 2 ? atol(argv[2]) : 64;
    long cells[64] = {0};
    for (long r = 0; r < rounds; r++) {
        long *p = &cells[2 * (nr() % 16)];
        const long *q = nr() % 100 < 95 ? p : &cells[32 + 2 * (nr() % 16)];
        sink += accumulate(p, q, n);
    }
    printf("%ld\n", (long)sink);
    return 0;
}
