/* A loop whose branch goes one way in eight, at random (the generator's top three bits; not in a
   pattern that the time of the instructions before it would follow): the rare side calls a chain of
   divisions (many cycles per execution), the common side is one shift and xor. Timer samples put
   most of the time on the rare side; the branch outcomes of sampled paths say how often each side
   runs. The loop runs 64 times a call of run(), so that sampled paths see it exit too (a loop whose
   exit neither they nor calc see has no shape: analysis/paths.py). */
#include <stdio.h>
#include <stdlib.h>

__attribute__((noinline)) static unsigned long rare(unsigned long x) {
    for (int k = 0; k < 8; k++)
        x = x / (3 + (x & 1)) + 7;
    return x;
}

__attribute__((noinline)) static unsigned long run(unsigned long *state, unsigned long acc) {
    unsigned long x = *state;
    for (int i = 0; i < 64; i++) {
        x = x * 6364136223846793005UL + 1442695040888963407UL;
        if ((x >> 61) == 0)
            acc += rare(x); /* rare side */
        else
            acc ^= x >> 7; /* common side */
    }
    *state = x;
    return acc;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 1000000;
    unsigned long acc = 1, x = 12345;
    for (long i = 0; i < n; i += 64)
        acc = run(&x, acc);
    printf("%lu\n", acc);
    return 0;
}
