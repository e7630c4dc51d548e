/* Functions that see known value distributions, for value sampling.
 *
 * scale(x): called with x = 3 70% of the time, 11 20%, and something else (spread over
 * 1000 values) 10%; its loop keeps x in a register, so samples in it see x as an operand.
 * offset_of(): called from two sites: site_a always passes 5, site_b one of 40 other values (more
 * than the paper's N = 16, which a hotlist of (value, call site) pairs shared with site_a's would
 * thin, but few enough that the per-call-site hotlist, N = 64, keeps every pair: its estimates are
 * exact, so the test of per-site detection does not depend on the hotlist's sampling error).
 * table_sum(): loads doubles from a table at an index drawn 70% 0, 30% spread.
 */
#include <stdio.h>
#include <stdlib.h>

static unsigned long long rng_state = 88172645463325252ULL;
static unsigned long next_rand(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (unsigned long)rng_state;
}

volatile long sink;
double table[4096];

__attribute__((noinline)) long scale(long x) {
    long acc = 0;
    for (long i = 0; i < 400; i++) {
        acc = acc * x + i;
        acc ^= acc >> 7;
    }
    return acc;
}

__attribute__((noinline)) long offset_of(long k) {
    long acc = k;
    for (long i = 0; i < 300; i++) acc = (acc * 31 + k) ^ (acc >> 3);
    return acc;
}

__attribute__((noinline)) long site_a(void) { return offset_of(5); }
__attribute__((noinline)) long site_b(void) { return offset_of(100 + (long)(next_rand() % 40)); }

__attribute__((noinline)) double table_sum(long idx) {
    double s = 0;
    for (int i = 0; i < 200; i++) s = s * 0.5 + table[(idx + i * 0) & 4095];
    return s;
}

int main(int argc, char **argv) {
    long rounds = argc > 1 ? atol(argv[1]) : 200000;
    for (int i = 0; i < 4096; i++) table[i] = i * 0.25;
    table[0] = 2.5;
    for (long r = 0; r < rounds; r++) {
        unsigned long u = next_rand() % 100;
        long x = u < 70 ? 3 : u < 90 ? 11 : 1000 + (long)(next_rand() % 1000);
        sink += scale(x);
        sink += (r & 1) ? site_a() : site_b();
        unsigned long v = next_rand() % 100;
        sink += (long)table_sum(v < 70 ? 0 : (long)(next_rand() % 4096));
    }
    printf("%ld\n", (long)sink);
    return 0;
}
