/* Small kernels with known behaviour for the accuracy benchmark (and skid calibration). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

__attribute__((noinline)) long chain(long n) {            /* a 3-cycle dependency chain */
    long s = 1;
    for (long i = 0; i < n; i++) s = (s * 31) ^ (i >> 2);
    return s;
}

__attribute__((noinline)) long divide(long n, long d) {   /* divider bound */
    long s = 0;
    for (long i = 1; i < n; i++) s += (s + i) / d;
    return s;
}

__attribute__((noinline)) long branchy(const unsigned char *buf, long n, int reps) {  /* data-dependent branches */
    long a = 0, b = 0;
    for (int r = 0; r < reps; r++)
        for (long i = 0; i < n; i++) {
            if (buf[i] & 1) a += buf[i]; else b ^= buf[i];
            if (buf[i] > 200) a -= 3;
        }
    return a + b;
}

__attribute__((noinline)) void saxpy(float *y, const float *x, float a, long n, int reps) {  /* streaming FP */
    for (int r = 0; r < reps; r++)
        for (long i = 0; i < n; i++) y[i] = a * x[i] + y[i];
}

__attribute__((noinline)) long nested(long n) {            /* loops in loops, with a diamond */
    long s = 0;
    for (long i = 0; i < n; i++)
        for (long j = 0; j < (i & 15) + 1; j++)
            s += (j & 1) ? i * j : i - j;
    return s;
}

int main(int argc, char **argv) {
    long scale = argc > 2 ? atol(argv[2]) : 1;  /* the loops' counts times this */
    const char *which = argc > 1 ? argv[1] : "all";
    int all = !strcmp(which, "all");
    long r = 0;
    if (all || !strcmp(which, "chain")) r += chain(300000000L * scale);
    if (all || !strcmp(which, "divide")) r += divide(30000000L * scale, 7);
    if (all || !strcmp(which, "branchy")) {
        long n = 1 << 16; unsigned char *buf = malloc(n); unsigned x = 12345;
        for (long i = 0; i < n; i++) { x = x * 1103515245u + 12345u; buf[i] = x >> 24; }
        r += branchy(buf, n, 1500);
    }
    if (all || !strcmp(which, "saxpy")) {
        long n = 1 << 14; float *x = malloc(n * 4), *y = malloc(n * 4);
        for (long i = 0; i < n; i++) { x[i] = i; y[i] = 1; }
        saxpy(y, x, 0.5f, n, 20000);
        r += (long)y[7];
    }
    if (all || !strcmp(which, "nested")) r += nested(20000000L * scale);
    printf("%ld\n", r);
    return 0;
}
