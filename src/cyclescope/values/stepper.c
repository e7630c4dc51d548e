/* The interpreter's inner loop: L instructions of one sampled state under unicorn, in C.
 *
 * Written by hand because no library does it: unicorn emulates, but recording what value
 * sampling needs after every instruction (registers, effective address, loaded and stored
 * values, where control went) means a hook per instruction, and a Python hook or a Python
 * loop of single steps costs 20-40 us a step here (ctypes calls, unicorn's per-start cost),
 * where this loop costs about 1 us. Python keeps everything that is not per step: decoding
 * (capstone, once per address), reading the process's memory, mapping pages. See interp.py.
 *
 * One context per emulated process. Per run: write the registers, write the stack snapshot
 * over its pages (saving what it covers), emulate with a code hook that closes the previous
 * step and opens the next, log the old bytes of every write (a write hook), and at the end put
 * everything back: the next run sees the process's memory, never this run's writes.
 *
 * Built by stepper.py with the C compiler against the libunicorn of the unicorn wheel.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unicorn/unicorn.h>

#define NREGS 18        /* ROW_REGS: 16 general-purpose registers, rip, flags */
#define R_RSP 7
#define R_RBP 6
#define R_RIP 16
#define PAGE 4096ULL
#define MAX_UNDO 512
#define MAX_WRITE 64    /* the widest store: a zmm register */
#define MAX_VRES 4      /* vector results recorded per step */

/* Why a run stopped: indexes into interp.STOP_REASONS; NEED_PLAN asks Python to decode. */
enum { R_LENGTH = 0, R_FAULT = 2, R_UNMAPPED = 3, R_VECTOR = 5, R_NEED_PLAN = 100, R_DEADLINE = 101, R_DONE = 102 };
#define LOST_FLAG 0x100 /* a write could not be undone: Python refreshes the data pages */

/* Plan flags */
#define P_MEM 1         /* has a memory operand it accesses */
#define P_READ 2
#define P_WRITE 4
#define P_STACK 8       /* push, pop, call, ret, leave: touches the stack implicitly */
#define P_LEAVE 16      /* leave: the stack it touches is at rbp */
#define REG_NONE (-1)
#define REG_RIP (-2)
#define REG_UNKNOWN (-3)

typedef struct {         /* what the loop needs of one instruction (filled by Python) */
    uint64_t pc;
    int64_t disp;
    uint64_t vread[2];   /* vector registers read: bits 0-95 (xmm0-31, ymm0-31, zmm0-31) */
    uint64_t vwrite[2];
    int32_t id;          /* the Python instruction's index */
    uint8_t stop;        /* a stop reason, or 0 */
    uint8_t flags;
    uint8_t size;        /* memory operand bytes */
    uint8_t isize;       /* instruction bytes */
    int8_t base, index;  /* ROW column, REG_NONE, REG_RIP or REG_UNKNOWN */
    uint8_t scale;
    uint8_t used;        /* slot taken (hash table) */
} plan_t;

typedef struct {         /* one step as numpy reads it (interp.STEP_DTYPE) */
    int32_t run, insn;
    uint64_t pc;
    uint64_t in[NREGS], out[NREGS];
    uint64_t ea, loaded, stored, next_pc;
    uint8_t has_ea, has_loaded, has_stored, sampled;
    int32_t nvres;
} step_t;

typedef struct { int32_t step, name; uint64_t value; } vres_t;

typedef struct {         /* the output of a drain's runs, shared by the contexts */
    step_t *steps;
    vres_t *vres;
    uint32_t cap, n, vcap, vn;
} out_t;

typedef int (*page_cb)(int32_t key, uint64_t page, int stack); /* map or refresh a page; 0 if it cannot be */

typedef struct { uint64_t addr; uint32_t size; uint8_t bytes[MAX_WRITE]; } undo_t;

typedef struct {
    uc_engine *uc;
    uc_hook hcode, hwrite;
    page_cb need_page;
    int32_t key;         /* the process, for need_page */
    plan_t *plans; uint32_t pcap, pcount;
    uint64_t *fresh; uint32_t *fresh_gen; uint32_t fcap, fcount; /* data pages current in a generation */
    uint32_t gen;
    /* the run in progress */
    out_t *out;
    const plan_t *pplan; /* the step in flight's plan */
    int32_t run;
    int L, done, pending, reason, lost;
    uint64_t need_pc;
    uint64_t known[2];
    uint64_t cur[NREGS];
    uint32_t nundo;
    undo_t undo[MAX_UNDO];
    uint64_t snap_addr; uint32_t snap_len;
    uint8_t *snap_saved; uint32_t snap_cap;
} ctx_t;

static const int REG_IDS[NREGS] = {
    UC_X86_REG_RAX, UC_X86_REG_RBX, UC_X86_REG_RCX, UC_X86_REG_RDX, UC_X86_REG_RSI, UC_X86_REG_RDI,
    UC_X86_REG_RBP, UC_X86_REG_RSP, UC_X86_REG_R8, UC_X86_REG_R9, UC_X86_REG_R10, UC_X86_REG_R11,
    UC_X86_REG_R12, UC_X86_REG_R13, UC_X86_REG_R14, UC_X86_REG_R15, UC_X86_REG_RIP, UC_X86_REG_EFLAGS};

static inline uint64_t hash64(uint64_t x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33;
    return x;
}

/* --- instruction plans: open addressing by pc ---------------------------------------------------- */
static plan_t *plan_find(ctx_t *c, uint64_t pc) {
    if (!c->pcap) return NULL;
    uint32_t m = c->pcap - 1, i = (uint32_t)hash64(pc) & m;
    while (c->plans[i].used) {
        if (c->plans[i].pc == pc) return &c->plans[i];
        i = (i + 1) & m;
    }
    return NULL;
}

static int plan_put(ctx_t *c, const plan_t *p) {
    if (2 * (c->pcount + 1) > c->pcap) {
        uint32_t ncap = c->pcap ? 2 * c->pcap : 1024;
        plan_t *old = c->plans; uint32_t ocap = c->pcap;
        plan_t *np = calloc(ncap, sizeof(plan_t));
        if (!np) return -1;
        c->plans = np; c->pcap = ncap; c->pcount = 0;
        for (uint32_t i = 0; i < ocap; i++)
            if (old[i].used) plan_put(c, &old[i]);
        free(old);
    }
    uint32_t m = c->pcap - 1, i = (uint32_t)hash64(p->pc) & m;
    while (c->plans[i].used && c->plans[i].pc != p->pc) i = (i + 1) & m;
    if (!c->plans[i].used) c->pcount++;
    c->plans[i] = *p;
    c->plans[i].used = 1;
    return 0;
}

/* --- data pages current in this generation ----------------------------------------------------- */
static int fresh_slot(ctx_t *c, uint64_t page, int insert) {
    if (insert && 2 * (c->fcount + 1) > c->fcap) {
        uint32_t ncap = c->fcap ? 2 * c->fcap : 256, ocap = c->fcap;
        uint64_t *op = c->fresh; uint32_t *og = c->fresh_gen;
        c->fresh = calloc(ncap, sizeof(uint64_t));
        c->fresh_gen = calloc(ncap, sizeof(uint32_t));
        if (!c->fresh || !c->fresh_gen) { free(c->fresh); free(c->fresh_gen); c->fresh = op; c->fresh_gen = og; return -1; }
        c->fcap = ncap; c->fcount = 0;
        for (uint32_t i = 0; i < ocap; i++)
            if (op[i]) { int s = fresh_slot(c, op[i], 1); c->fresh_gen[s] = og[i]; }
        free(op); free(og);
    }
    if (!c->fcap) return -1;
    uint32_t m = c->fcap - 1, i = (uint32_t)hash64(page) & m;
    while (c->fresh[i] && c->fresh[i] != page) i = (i + 1) & m;
    if (!c->fresh[i]) {
        if (!insert) return -1;
        c->fresh[i] = page; c->fresh_gen[i] = 0; c->fcount++;
    }
    return (int)i;
}

/* Make [addr, addr+size) current for this generation (Python maps or refreshes stale pages). */
static int ensure(ctx_t *c, uint64_t addr, uint64_t size, int stack) {
    uint64_t end = addr + (size ? size : 1);
    for (uint64_t page = addr & ~(PAGE - 1); page < end; page += PAGE) {
        if (page == 0) return 0; /* page 0 is never mapped; also the table's empty key */
        int s = fresh_slot(c, page, 0);
        if (s >= 0 && c->fresh_gen[s] == c->gen) continue;
        if (!c->need_page(c->key, page, stack)) return 0;
        s = fresh_slot(c, page, 1);
        if (s >= 0) c->fresh_gen[s] = c->gen;
    }
    return 1;
}

/* --- the hooks ---------------------------------------------------------------------------------- */
static uint64_t read_value(ctx_t *c, uint64_t ea, uint32_t size, int *ok) {
    uint8_t buf[8] = {0};
    uint32_t n = size < 8 ? size : 8;
    *ok = n > 0 && uc_mem_read(c->uc, ea, buf, n) == UC_ERR_OK;
    uint64_t v = 0;
    for (uint32_t i = 0; i < n; i++) v |= (uint64_t)buf[i] << (8 * i);
    return v;
}

static void read_row(uc_engine *uc, uint64_t *row) {
    void *p[NREGS];
    for (int i = 0; i < NREGS; i++) p[i] = &row[i];
    uc_reg_read_batch(uc, (int *)REG_IDS, p, NREGS);
}

/* Close the step in flight: its output registers, stored value, vector results. */
static void finish(ctx_t *c) {
    step_t *s = &c->out->steps[c->out->n];
    const plan_t *p = c->pplan;
    read_row(c->uc, s->out);
    s->next_pc = s->out[R_RIP];
    if ((p->flags & P_WRITE) && s->has_ea) {
        int ok;
        s->stored = read_value(c, s->ea, p->size, &ok);
        s->has_stored = (uint8_t)ok;
    }
    s->nvres = 0;
    if (p->vwrite[0] | p->vwrite[1]) {
        for (int b = 0; b < 96; b++) {
            if (!((p->vwrite[b >> 6] >> (b & 63)) & 1)) continue;
            c->known[b >> 6] |= 1ULL << (b & 63);
            if (s->nvres >= MAX_VRES || c->out->vn >= c->out->vcap) continue;
            uint8_t buf[64] = {0};
            if (uc_reg_read(c->uc, UC_X86_REG_XMM0 + b, buf) != UC_ERR_OK) continue;
            vres_t *v = &c->out->vres[c->out->vn++];
            v->step = (int32_t)c->out->n;
            v->name = b;
            memcpy(&v->value, buf, 8);
            s->nvres++;
        }
    }
    memcpy(c->cur, s->out, sizeof c->cur);
    c->out->n++;
    c->done++;
    c->pending = 0;
}

/* Open a step at pc: its input registers, effective address, loaded value. 0: unmapped memory. */
static int begin(ctx_t *c, const plan_t *p, uint64_t pc) {
    step_t *s = &c->out->steps[c->out->n];
    s->run = c->run;
    s->insn = p->id;
    s->pc = pc;
    memcpy(s->in, c->cur, sizeof c->cur);
    s->sampled = c->done == 0;
    s->has_ea = s->has_loaded = s->has_stored = 0;
    s->ea = s->loaded = s->stored = 0;
    if (p->flags & P_MEM) {
        uint64_t a = (uint64_t)p->disp;
        int known = 1;
        if (p->base == REG_RIP) a += pc + p->isize;
        else if (p->base >= 0) a += c->cur[p->base];
        else if (p->base == REG_UNKNOWN) known = 0;
        if (p->index >= 0) a += c->cur[p->index] * p->scale;
        else if (p->index == REG_UNKNOWN) known = 0;
        if (known) {
            s->ea = a;
            s->has_ea = 1;
            if (!ensure(c, a, p->size, 0)) return 0;
            if (p->flags & P_READ) {
                int ok;
                s->loaded = read_value(c, a, p->size, &ok);
                s->has_loaded = (uint8_t)ok;
            }
        }
    }
    if (p->flags & P_STACK) {
        uint64_t sp = c->cur[(p->flags & P_LEAVE) ? R_RBP : R_RSP];
        if (!ensure(c, sp - 8, 16, 0)) return 0;
    }
    c->pplan = p;
    c->pending = 1;
    return 1;
}

static void on_code(uc_engine *uc, uint64_t addr, uint32_t size, void *user) {
    ctx_t *c = user;
    (void)size;
    if (c->pending) finish(c);
    if (c->done >= c->L) { c->reason = R_LENGTH; uc_emu_stop(uc); return; }
    plan_t *p = plan_find(c, addr);
    if (!p) { c->reason = R_NEED_PLAN; c->need_pc = addr; uc_emu_stop(uc); return; }
    if (p->stop) { c->reason = p->stop; uc_emu_stop(uc); return; }
    if ((p->vread[0] & ~c->known[0]) | (p->vread[1] & ~c->known[1])) {
        c->reason = R_VECTOR; uc_emu_stop(uc); return;
    }
    if (!begin(c, p, addr)) { c->reason = R_UNMAPPED; uc_emu_stop(uc); return; }
}

static void on_write(uc_engine *uc, uc_mem_type type, uint64_t addr, int size, int64_t value, void *user) {
    ctx_t *c = user;
    (void)type; (void)value;
    if (c->nundo >= MAX_UNDO || size <= 0 || size > MAX_WRITE) { c->lost = 1; return; }
    undo_t *u = &c->undo[c->nundo];
    if (uc_mem_read(uc, addr, u->bytes, (size_t)size) != UC_ERR_OK) { c->lost = 1; return; }
    u->addr = addr;
    u->size = (uint32_t)size;
    c->nundo++;
}

/* --- the API (ctypes) ---------------------------------------------------------------------------- */
ctx_t *stp_new(uc_engine *uc, page_cb need_page, int32_t key) {
    ctx_t *c = calloc(1, sizeof(ctx_t));
    if (!c) return NULL;
    c->uc = uc;
    c->need_page = need_page;
    c->key = key;
    if (uc_hook_add(uc, &c->hcode, UC_HOOK_CODE, (void *)on_code, c, 1, 0) != UC_ERR_OK ||
        uc_hook_add(uc, &c->hwrite, UC_HOOK_MEM_WRITE, (void *)on_write, c, 1, 0) != UC_ERR_OK) {
        free(c);
        return NULL;
    }
    return c;
}

/* Free a context; ``unhook``: the emulator lives on, take the hooks off it (not when the emulator
 * may be closed already, as in a garbage collector's finalizer). */
void stp_free(ctx_t *c, int unhook) {
    if (!c) return;
    if (unhook) {
        uc_hook_del(c->uc, c->hcode);
        uc_hook_del(c->uc, c->hwrite);
    }
    free(c->plans); free(c->fresh); free(c->fresh_gen); free(c->snap_saved);
    free(c);
}

int stp_add_plan(ctx_t *c, const plan_t *p) { return plan_put(c, p); }

uint32_t stp_plan_count(ctx_t *c) { return c->pcount; }

void stp_clear_plans(ctx_t *c) {
    free(c->plans);
    c->plans = NULL;
    c->pcap = c->pcount = 0;
}

/* The structures' sizes, checked against the Python side's at load. */
void stp_sizes(uint32_t *out) {
    out[0] = sizeof(plan_t);
    out[1] = sizeof(step_t);
    out[2] = sizeof(vres_t);
    out[3] = sizeof(out_t);
}

uint64_t stp_need_pc(ctx_t *c) { return c->need_pc; }

/* Every data page is stale: the next touch refreshes it (after a write that could not be undone). */
static void forget_pages(ctx_t *c) {
    for (uint32_t i = 0; i < c->fcap; i++) c->fresh_gen[i] = 0;
}

static void end_run(ctx_t *c) {
    for (uint32_t i = c->nundo; i-- > 0;)
        uc_mem_write(c->uc, c->undo[i].addr, c->undo[i].bytes, c->undo[i].size);
    c->nundo = 0;
    if (c->snap_len) uc_mem_write(c->uc, c->snap_addr, c->snap_saved, c->snap_len);
    c->snap_len = 0;
}

/* Emulate from the current state until the run stops; the reason (NEED_PLAN: add the plan for
 * stp_need_pc and call again; the run's state is kept). */
int stp_go(ctx_t *c) {
    c->reason = -1;
    uc_err err = uc_emu_start(c->uc, c->cur[R_RIP], 0, 0, 0);
    if (c->reason == R_NEED_PLAN && err == UC_ERR_OK) return R_NEED_PLAN;
    if (err != UC_ERR_OK) {
        c->pending = 0; /* the step in flight did not complete */
        c->reason = (err == UC_ERR_READ_UNMAPPED || err == UC_ERR_WRITE_UNMAPPED || err == UC_ERR_FETCH_UNMAPPED)
                        ? R_UNMAPPED : R_FAULT;
    } else if (c->pending) {
        finish(c); /* stopped from outside the hook */
    }
    if (c->reason < 0) c->reason = R_LENGTH;
    end_run(c);
    int r = c->reason | (c->lost ? LOST_FLAG : 0);
    if (c->lost) forget_pages(c);
    return r;
}

/* Start a run: registers ``row`` (ROW_REGS), the stack snapshot at row's rsp, L steps at most,
 * vector registers ``known`` (bits as in plan_t), steps appended to ``out`` tagged ``run``. The
 * caller makes room for L steps and 4 L vector results in ``out``. */
int stp_run(ctx_t *c, out_t *out, const uint64_t *row, const uint8_t *stack, uint32_t slen, int L, int32_t run,
            uint32_t gen, uint64_t known0, uint64_t known1) {
    c->out = out;
    c->run = run;
    c->L = L;
    c->done = c->pending = c->lost = 0;
    c->nundo = 0;
    c->gen = gen;
    c->known[0] = known0;
    c->known[1] = known1;
    memcpy(c->cur, row, sizeof c->cur);
    void *p[NREGS];
    for (int i = 0; i < NREGS; i++) p[i] = &c->cur[i];
    uc_reg_write_batch(c->uc, (int *)REG_IDS, p, NREGS);
    c->snap_len = 0;
    if (slen) {
        uint64_t rsp = row[R_RSP];
        if (slen > c->snap_cap) {
            uint8_t *b = realloc(c->snap_saved, slen);
            if (b) { c->snap_saved = b; c->snap_cap = slen; }
        }
        /* The snapshot's pages: mapped as zeros if the process's cannot be read. */
        if (slen <= c->snap_cap && ensure(c, rsp, slen, 1) && uc_mem_read(c->uc, rsp, c->snap_saved, slen) == UC_ERR_OK) {
            uc_mem_write(c->uc, rsp, stack, slen);
            c->snap_addr = rsp;
            c->snap_len = slen;
        }
    }
    return stp_go(c);
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t); /* Python's time.perf_counter_ns clock */
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* A drain's runs: run j starts from rows[j] (NREGS words) with the stack snapshot at
 * stacks + j * stride (slens[j] bytes), in context ctxs[j], tagged j; its reason goes to
 * reasons[j]. From run ``start`` on; every 8 runs the clock is checked against ``deadline_ns``
 * (0: none). Returns R_DONE, R_DEADLINE (runs from *at on were not started) or R_NEED_PLAN (run
 * *at is in progress: add the plan and finish it with stp_go, then call again from *at + 1).
 * The caller makes room in ``out`` for L steps a run. */
int stp_run_many(ctx_t **ctxs, out_t *out, const uint64_t *rows, const uint8_t *stacks, uint32_t stride,
                 const uint32_t *slens, int32_t n, int L, uint32_t gen, int64_t deadline_ns, int32_t start,
                 uint8_t *reasons, int32_t *at) {
    for (int32_t j = start; j < n; j++) {
        if (deadline_ns && j % 8 == 0 && now_ns() > deadline_ns) { *at = j; return R_DEADLINE; }
        int r = stp_run(ctxs[j], out, rows + (size_t)j * NREGS, stacks + (size_t)j * stride, slens[j], L, j, gen, 0, 0);
        if (r == R_NEED_PLAN) { *at = j; return R_NEED_PLAN; }
        reasons[j] = (uint8_t)(r & 0xFF);
    }
    *at = n;
    return R_DONE;
}
