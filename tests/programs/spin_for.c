/* Spins for argv[1] seconds of wall time (forever without an argument). */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
int main(int argc, char **argv) {
    double secs = argc > 1 ? atof(argv[1]) : 1e9;
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    volatile unsigned long x = 1;
    do {
        for (int i = 0; i < 1000000; i++) x = x * 31 + i;
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while ((t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) * 1e-9 < secs);
    return (int)(x & 0);
}
