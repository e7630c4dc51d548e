/* Golden-test program: an inlined helper and a hot loop. */
#include <stdio.h>
#include <stdlib.h>

static inline long step(long s, long i) {
    return (s * 31) ^ (i >> 2);
}

__attribute__((noinline)) long work(long n) {
    long s = 1;
    for (long i = 0; i < n; i++)
        s = step(s, i);
    return s;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 100000000;
    printf("%ld\n", work(n));
    return 0;
}
