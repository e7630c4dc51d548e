/* cyclescope's demo workload: four kernels with different costs per call.
 *
 *   matmul      dense arithmetic on small matrices (compute bound)
 *   chase       pointer chasing through a shuffled list (memory bound)
 *   hash_probe  open-addressing lookups (mixed)
 *   checksum    a byte loop (cheap)
 *
 * Build: gcc -O2 -g -o workload workload.c
 * Usage: workload [scale]    (scale 1 runs about 2 s here)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N 64
static double A[N][N], B[N][N], C[N][N];

__attribute__((noinline)) double matmul(int reps) {
    for (int r = 0; r < reps; r++)
        for (int i = 0; i < N; i++)
            for (int k = 0; k < N; k++) {
                double a = A[i][k];
                for (int j = 0; j < N; j++) C[i][j] += a * B[k][j];
            }
    return C[N / 2][N / 2];
}

typedef struct node { struct node *next; long pad[7]; } node;

__attribute__((noinline)) long chase(node *head, long steps) {
    long n = 0;
    node *p = head;
    for (long s = 0; s < steps; s++) { p = p->next; n += (long)(p->pad[0] & 1); }
    return n;
}

#define HSIZE (1 << 16)
static uint64_t keys[HSIZE];

__attribute__((noinline)) long hash_probe(long lookups, uint64_t seed) {
    long found = 0;
    uint64_t x = seed;
    for (long i = 0; i < lookups; i++) {
        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
        uint64_t k = (x >> 33) | 1;
        uint64_t h = (k * 0x9E3779B97F4A7C15ULL) >> 48;
        while (keys[h] && keys[h] != k) h = (h + 1) & (HSIZE - 1);
        found += keys[h] == k;
    }
    return found;
}

__attribute__((noinline)) unsigned checksum(const unsigned char *buf, long n, int reps) {
    unsigned s = 0;
    for (int r = 0; r < reps; r++)
        for (long i = 0; i < n; i++) s = (s << 1 | s >> 31) ^ buf[i];
    return s;
}

int main(int argc, char **argv) {
    double scale = argc > 1 ? atof(argv[1]) : 1.0;
    for (int i = 0; i < N; i++)
        for (int j = 0; j < N; j++) { A[i][j] = i + j; B[i][j] = i - j; }
    long nn = 1 << 20;
    node *nodes = malloc(nn * sizeof(node));
    long *perm = malloc(nn * sizeof(long));
    for (long i = 0; i < nn; i++) perm[i] = i;
    uint64_t x = 42;
    for (long i = nn - 1; i > 0; i--) {
        x = x * 6364136223846793005ULL + 1;
        long j = (long)((x >> 33) % (uint64_t)(i + 1));
        long t = perm[i]; perm[i] = perm[j]; perm[j] = t;
    }
    for (long i = 0; i < nn; i++) { nodes[perm[i]].next = &nodes[perm[(i + 1) % nn]]; nodes[i].pad[0] = i; }
    for (long i = 0; i < HSIZE / 2; i++) {
        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
        uint64_t k = (x >> 33) | 1, h = (k * 0x9E3779B97F4A7C15ULL) >> 48;
        while (keys[h]) h = (h + 1) & (HSIZE - 1);
        keys[h] = k;
    }
    unsigned char *buf = malloc(1 << 16);
    memset(buf, 7, 1 << 16);
    double m = matmul((int)(1200 * scale));
    long c = chase(&nodes[0], (long)(12e6 * scale));
    long h = hash_probe((long)(25e6 * scale), 7);
    unsigned s = checksum(buf, 1 << 16, (int)(1500 * scale));
    printf("matmul %.0f chase %ld hash %ld checksum %u\n", m, c, h, s);
    return 0;
}
