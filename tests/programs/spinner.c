/* Spins until killed, in spin_here(); prints its pid and waits for a line first if asked. */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

volatile long sink;

__attribute__((noinline)) void spin_here(void) {
    for (;;) for (long i = 0; i < 1000000; i++) sink += i;
}

int main(void) {
    printf("%d\n", getpid());
    fflush(stdout);
    spin_here();
    return 0;
}
