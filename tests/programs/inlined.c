/* A function with a loop inlined into a loop (clang unrolls it): nested profiles and duplication
 * factors for `export llvm-sample`. mix runs 50..57 iterations a call. */
#include <stdio.h>
#include <stdlib.h>

static inline unsigned long mix(unsigned long x, int k) {
    for (int i = 0; i < k; i++)
        x = x * 6364136223846793005UL + (unsigned long)i;
    return x;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 1000000;
    unsigned long s = 0;
    for (long i = 0; i < n; i++)
        s += mix((unsigned long)i, 50 + (int)(i & 7));
    printf("%lu\n", s);
    return 0;
}
