/* A procedure entered a known number of times, each call long (tens of microseconds) and its loop's
 * exit a value, not a count: no register counts it, only its entry can be counted exactly (anchors).
 * Usage: entries CALLS MODULUS (each call runs MODULUS iterations on average). */
#include <stdio.h>
#include <stdlib.h>

__attribute__((noinline)) unsigned long mid(unsigned long x, unsigned long n) {
    unsigned long s = x;
    do {
        s = s * 6364136223846793005UL + 1442695040888963407UL;
    } while ((s >> 40) % n != 0);
    return s;
}

int main(int argc, char **argv) {
    long calls = argc > 1 ? atol(argv[1]) : 10000;
    volatile unsigned long n = argc > 2 ? strtoul(argv[2], 0, 10) : 100000;
    unsigned long s = 0;
    for (long i = 0; i < calls; i++)
        s += mid(s + (unsigned long)i, n);
    printf("%lu\n", s);
    return 0;
}
