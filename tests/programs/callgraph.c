/* Known call stacks: main -> outer -> inner -> leaf (twice) and main -> outer -> leaf.
 * leaf runs 200 multiply-adds a call, so about two thirds of the time is under inner. */
#include <stdio.h>
#include <stdlib.h>

__attribute__((noinline)) unsigned long leaf(unsigned long x) {
    for (int i = 0; i < 200; i++)
        x = x * 6364136223846793005UL + 1442695040888963407UL;
    return x;
}

__attribute__((noinline)) unsigned long inner(unsigned long x) { return leaf(x) ^ leaf(x + 1); }

__attribute__((noinline)) unsigned long outer(unsigned long x) { return inner(x) + leaf(x * 3); }

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 2000000;
    unsigned long s = 0;
    for (long i = 0; i < n; i++)
        s += outer((unsigned long)i);
    printf("%lu\n", s);
    return 0;
}
