/* A difference of two registers planted for `specialize` (goal-directed value profiling): mix's
 * loop compares its two arguments x and y on every trip (gcc -O2 keeps `cmp rdx, rcx` in the loop);
 * they are equal on 95% of the calls, so the difference x - y is 0: knowing it folds the compare and
 * both branches. Arguments: calls (default 2,000,000), elements per call (default 64).
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

__attribute__((noinline)) long mix(const long *a, long n, long x, long y) {
    long s = 0;
    for (long i = 0; i < n; i++) {
        if (x == y) s += a[i];
        else if (x < y) s -= a[i] * 3;
        else s ^= a[i];
    }
    return s;
}

int main(int argc, char **argv) {
    long rounds = argc > 1 ? atol(argv[1]) : 2000000, n = argc > 2 ? atol(argv[2]) : 64;
    long *a = malloc(n * sizeof *a);
    if (!a) return 1;
    for (long i = 0; i < n; i++) a[i] = (long)nr();
    for (long r = 0; r < rounds; r++) {
        long x = (long)(nr() % 1000), y = nr() % 100 < 95 ? x : (long)(nr() % 1000);
        sink += mix(a, n, x, y);
    }
    printf("%ld\n", (long)sink);
    return 0;
}
