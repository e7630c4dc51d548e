/* Two phases of pure computation, alternating at lengths of 50-400 ms of CPU time (a fixed
 * pseudo-random sequence), for about SECONDS seconds. Prints the share of CPU time phase_a took,
 * as measured by the thread's own clock: the truth a profile's shares are compared with. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

__attribute__((noinline)) unsigned long phase_a(unsigned long x, double secs) {
    double end = now() + secs;
    do { for (int i = 0; i < 20000; i++) x = x * 6364136223846793005UL + 1; } while (now() < end);
    return x;
}

__attribute__((noinline)) unsigned long phase_b(unsigned long x, double secs) {
    double end = now() + secs;
    do { for (int i = 0; i < 20000; i++) x = (x ^ (x >> 7)) * 2654435761UL; } while (now() < end);
    return x;
}

int main(int argc, char **argv) {
    double total = argc > 1 ? atof(argv[1]) : 4.0, ta = 0, tb = 0;
    unsigned long x = 1, r = 12345;
    while (ta + tb < total) {
        r = r * 1103515245 + 12345;
        double len = 0.05 + (double)((r >> 16) % 351) / 1000.0;
        double t0 = now();
        if ((r >> 8) & 1) { x = phase_a(x, len); ta += now() - t0; }
        else { x = phase_b(x, len); tb += now() - t0; }
    }
    printf("%.4f %lu\n", ta / (ta + tb), x & 1);
    return 0;
}
