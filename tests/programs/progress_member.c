/* A match finder whose position is no argument: find(m) reads m->pos from the structure it is
 * passed (lzip's LZ_encoder::get_match_pairs reads this->pos) and walks until a sum of
 * pseudo-random steps passes a bound, as progress.c's find() does; main advances m->pos by one,
 * or by two or three after a call that returned 3. The position is loaded into a register before
 * the loop and kept there: the value the procedure's progress point follows (analysis/progress.py).
 * Prints the calls and the inner loop's executions.
 * Usage: progress_member POSITIONS */
#include <stdio.h>
#include <stdlib.h>

struct finder {
    const unsigned char *buf;
    unsigned long pos;
};

static volatile unsigned long k; /* in memory: no register counts the inner loop */

__attribute__((noinline)) unsigned find(struct finder *m) {
    unsigned long pos = m->pos;
    unsigned long s = (pos ^ m->buf[pos & 4095]) * 0x9E3779B97F4A7C15UL;
    unsigned acc = 0;
    do {
        s = s * 6364136223846793005UL + 1442695040888963407UL;
        acc += (s >> 59) + (s == pos); /* pos stays in its register */
        k++;
    } while (acc < 128);
    return (unsigned)(s >> 62);
}

int main(int argc, char **argv) {
    unsigned long n = argc > 1 ? strtoul(argv[1], NULL, 10) : 100000000UL;
    unsigned char *buf = malloc(4096);
    for (int i = 0; i < 4096; i++)
        buf[i] = (unsigned char)(i * 131);
    struct finder m = {buf, 0};
    unsigned long calls = 0;
    while (m.pos < n) {
        /* Zero the argument registers find() does not take: gcc knows find() leaves m->pos in r8
         * and keeps it there across the call, so r8 at the next entry would move with the
         * position, one call behind, and an argument would follow it as well as the point does.
         * A caller with work of its own between the calls leaves no such trail. */
        __asm__ volatile("xor %%esi, %%esi\n\txor %%edx, %%edx\n\txor %%ecx, %%ecx\n\t"
                         "xor %%r8d, %%r8d\n\txor %%r9d, %%r9d"
                         ::: "rsi", "rdx", "rcx", "r8", "r9");
        unsigned r = find(&m);
        calls++;
        m.pos += r == 3 ? 1 + (m.pos & 1) + 1 : 1;
    }
    printf("%lu %lu\n", calls, k);
    return 0;
}
