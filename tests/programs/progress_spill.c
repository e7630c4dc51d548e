/* progress.c's match finder with its position spilled to the stack, as zstd's
 * ZSTD_DUBT_findBestMatch spills its ip: the inner loop says it clobbers every general register but
 * rsp (an empty asm; a loop with many live values does the same to the compiler), so gcc keeps pos in
 * a stack slot through the loop and no register holds it there. The samples follow it in the stack
 * words they carry (perf/abi.STACK_WORDS; analysis/progress.py). Prints the calls and the inner
 * loop's executions.
 * Usage: progress_spill POSITIONS */
#include <stdio.h>
#include <stdlib.h>

static volatile unsigned long k;  /* in memory: no register counts the inner loop */

__attribute__((noipa)) unsigned long seed(unsigned long pos, unsigned char b) {
    return (pos ^ b) * 0x9E3779B97F4A7C15UL;
}

/* It calls seed(): a leaf would keep its slots in the red zone below rsp, which no sample carries. */
__attribute__((noinline)) unsigned find(const unsigned char *buf, unsigned long pos) {
    unsigned long s = seed(pos, buf[pos & 4095]);
    unsigned acc = 0;
    do {
        __asm__ volatile("" ::: "rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "r8", "r9", "r10", "r11", "r12",
                         "r13", "r14", "r15", "memory");
        s = s * 6364136223846793005UL + 1442695040888963407UL;
        acc += (s >> 59) + (s == pos);  /* pos read back from its slot */
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
