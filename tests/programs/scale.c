/* A short procedure with rare blocks, for scale points (analysis/trips.py, "Scale windows"): `step`
 * is called about twenty million times a second, so that its anchor's traps would set its pace,
 * and has a loop, so that trip windows count it; about one call in 128 and one in 200 take a
 * branch of their own, at random (its argument is a hash: no argument moves forward, so that its
 * entry count comes from nothing else). Arguments: calls (default 100,000,000), elements per call
 * (default 64). Prints the calls and the rare blocks' runs.
 */
#include <stdio.h>
#include <stdlib.h>

volatile long sink;
long rare1, rare2;

__attribute__((noinline)) long step(const long *a, long n, long k) {
    long s = 0;
    for (long i = 0; i < n; i++) s += a[i] ^ k;
    if ((k & 127) == 0) {
        rare1++;
        s = s * 3 + 1;
    }
    if ((unsigned long)k % 200 == 7) {
        rare2++;
        s ^= s >> 3;
    }
    return s;
}

int main(int argc, char **argv) {
    long calls = argc > 1 ? atol(argv[1]) : 100000000, n = argc > 2 ? atol(argv[2]) : 64;
    long *a = malloc(n * sizeof *a);
    if (!a) return 1;
    for (long i = 0; i < n; i++) a[i] = i * 2654435761L;
    unsigned long h = 88172645463325252UL;
    for (long r = 0; r < calls; r++) {
        h ^= h << 13;
        h ^= h >> 7;
        h ^= h << 17;
        sink += step(a, n, (long)h);
    }
    printf("%ld %ld %ld\n", calls, rare1, rare2);
    return 0;
}
