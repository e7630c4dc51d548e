/* Forks N children that each exec a short-lived copy of a busy command (DCPI's gcc case). */
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

__attribute__((noinline)) long child_work(long n) {
    long s = 0;
    for (long i = 0; i < n; i++) s += i ^ (s << 1);
    return s;
}

int main(int argc, char **argv) {
    int kids = argc > 1 ? atoi(argv[1]) : 20;
    long work = argc > 2 ? atol(argv[2]) : 5000000;
    if (argc > 3) { printf("%ld\n", child_work(work)); return 0; }  /* the exec'd child */
    char buf[32];
    snprintf(buf, sizeof buf, "%ld", work);
    for (int k = 0; k < kids; k++) {
        pid_t p = fork();
        if (p == 0) { execl(argv[0], argv[0], "0", buf, "child", (char *)0); _exit(127); }
        waitpid(p, 0, 0);
    }
    return 0;
}
