/* A procedure entered tens of millions of times a second, called with an argument that moves
 * forward: a match finder's shape. find() walks until a sum of pseudo-random steps passes a bound
 * (about 8 trips; no register counts it), and main calls it at every position except the one or
 * two after a call that returned 3, which it skips (about 1.6 positions a call). No anchor can
 * count its entries all the time; the position's move per entry (trip windows) and over the run
 * (samples) give them (analysis/progress.py). Prints the calls and the inner loop's executions.
 * Usage: progress POSITIONS */
#include <stdio.h>
#include <stdlib.h>

static volatile unsigned long k;  /* in memory: no register counts the inner loop */

__attribute__((noinline)) unsigned find(const unsigned char *buf, unsigned long pos) {
    unsigned long s = (pos ^ buf[pos & 4095]) * 0x9E3779B97F4A7C15UL;
    unsigned acc = 0;
    do {
        s = s * 6364136223846793005UL + 1442695040888963407UL;
        acc += (s >> 59) + (s == pos);  /* pos stays in its register */
        k++;
    } while (acc < 128);
    return (unsigned)(s >> 62);
}

int main(int argc, char **argv) {
    unsigned long n = argc > 1 ? strtoul(argv[1], NULL, 10) : 100000000UL;
    unsigned char *buf = malloc(4096);
    for (int i = 0; i < 4096; i++)
        buf[i] = (unsigned char)(i * 131);
    unsigned long calls = 0;
    for (unsigned long pos = 0; pos < n;) {
        unsigned r = find(buf, pos);
        calls++;
        pos += r == 3 ? 1 + (pos & 1) + 1 : 1;
    }
    printf("%lu %lu\n", calls, k);
    return 0;
}
