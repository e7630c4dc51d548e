/* A loop whose exit is a value inside a counted loop: the outer loop's count comes from its counter
 * register (loop counters), the inner loop's trips per outer iteration from nothing a sample holds
 * (it runs until a sum of pseudo-random steps passes a bound: about 17 trips, varying little). The
 * program prints the inner loop's exact executions.
 * Usage: trips OUTER */
#include <stdio.h>
#include <stdlib.h>

static volatile unsigned long k;  /* in memory: no register counts the inner loop */

__attribute__((noinline)) unsigned long walk(long n, unsigned long *runs) {
    unsigned long s = 88172645463325252UL;
    for (long i = 0; i < n; i++) {
        unsigned long acc = 0;
        s ^= (unsigned long)i;
        do {
            s = s * 6364136223846793005UL + 1442695040888963407UL;
            acc += s >> 59;
            k++;
        } while (acc < 256);
    }
    *runs = k;
    return s;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 10000000;
    unsigned long runs = 0;
    unsigned long s = walk(n, &runs);
    printf("%lu %lu\n", runs, s & 1);
    return 0;
}
