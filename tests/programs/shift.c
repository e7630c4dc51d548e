/* Work that moves between two functions: `shift a` spends about 80% in steady() and 20% in
 * grows(), `shift b` the reverse. A diff of the two runs must flag both. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Leaves, each with its own loop: gcc omits a leaf's frame pointer, so their stacks read
 * main -> steady and main -> grows (the leaf's caller, run, is hidden, as with any frameless leaf). */
__attribute__((noinline)) unsigned long steady(unsigned long x, long n) {
    for (long i = 0; i < n; i++)
        x = x * 6364136223846793005UL + 1442695040888963407UL;
    return x ^ 1;
}

__attribute__((noinline)) unsigned long grows(unsigned long x, long n) {
    for (long i = 0; i < n; i++)
        x = x * 2862933555777941757UL + 3037000493UL;
    return x ^ 2;
}

__attribute__((noinline)) unsigned long run(int b, long rounds) {
    unsigned long s = 0;
    for (long r = 0; r < rounds; r++) {
        s += steady(s, b ? 2000 : 8000);
        s += grows(s, b ? 8000 : 2000);
    }
    return s;
}

int main(int argc, char **argv) {
    int b = argc > 1 && strcmp(argv[1], "b") == 0;
    long rounds = argc > 2 ? atol(argv[2]) : 60000;
    printf("%lu\n", run(b, rounds));
    return 0;
}
