/* Two functions with a known ratio of work: hot() does 9 times cold()'s. */
#include <stdio.h>
#include <stdlib.h>

__attribute__((noinline)) long hot(long n) {
    long s = 0;
    for (long i = 0; i < n; i++) s += (i * i) ^ (s >> 3);
    return s;
}

__attribute__((noinline)) long cold(long n) {
    long s = 0;
    for (long i = 0; i < n; i++) s += (i * i) ^ (s >> 3);
    return s;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 300000000;
    printf("%ld\n", hot(9 * (n / 10)) + cold(n / 10));
    return 0;
}
