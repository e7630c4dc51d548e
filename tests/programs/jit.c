/* A tiny "JIT": copies a function's machine code into anonymous executable memory,
 * writes /tmp/perf-PID.map for it, and runs it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* mov rax, rdi; loop: dec rax; jnz loop; ret  -- spins n times */
static const unsigned char code[] = {0x48, 0x89, 0xf8, 0x48, 0xff, 0xc8, 0x75, 0xfb, 0xc3};

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 2000000000L;
    unsigned char *mem = mmap(0, 4096, PROT_READ | PROT_WRITE | PROT_EXEC, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    memcpy(mem, code, sizeof code);
    char path[64];
    snprintf(path, sizeof path, "/tmp/perf-%d.map", getpid());
    FILE *f = fopen(path, "w");
    fprintf(f, "%lx %zx jitted_spin_loop\n", (unsigned long)mem, sizeof code);
    fclose(f);
    long (*fn)(long) = (long (*)(long))mem;
    printf("%ld\n", fn(n));
    return 0;
}
