// SPDX-License-Identifier: GPL-2.0
/* cyclescope's in-kernel sample aggregation (collect/ebpf.py loads it).
 *
 * Attached to every sampling perf event (the event's index in the session is the link's cookie),
 * it runs at each overflow instead of writing a sample record: it counts the sample under
 * (process, ip, kernel or user, event, stack) in a hash map, with the sum of the events' periods
 * and the time of the last one, and returns 0 so that the ring buffer carries only the side
 * records (mmap, comm, fork, exit). User space reads and empties the maps of one generation while
 * the program fills the other's (control.gen), so that nothing is read while it is written.
 *
 * Stacks (control.stacks): the kernel frames and the user frames (walked with frame pointers, as
 * PERF_SAMPLE_CALLCHAIN does) copied with bpf_get_stack, hashed, and stored once per generation
 * under their hash. The kernel's stack-trace map is not used: it drops a stack whose bucket holds
 * another, a loss that grows with the number of distinct stacks.
 *
 * Python (with stacks): for a CPython 3.11+ process user space has described (py_procs), the
 * sampled thread's Python frames are read from the interpreter's memory and kept with the stack:
 * their code objects and instruction pointers, which user space names (function, file, line).
 *
 * Only uapi headers: the program reads the perf context (struct bpf_perf_event_data), user memory
 * and calls helpers, never a kernel structure, so it needs no relocation and runs on any kernel
 * with bpf_get_attach_cookie (5.15) and bpf_loop (5.17).
 */
#include <linux/bpf.h>
#include <linux/bpf_perf_event.h>
#include <linux/ptrace.h>
#include <bpf/bpf_helpers.h>

#define MAX_KERNEL 32
#define MAX_USER 96
#define MAX_FRAMES (MAX_KERNEL + MAX_USER)
#define MAX_PY 32       /* Python frames kept, innermost first */
#define MAX_PY_WALK 64  /* frames looked at (shim frames of 3.12+ are skipped) */
#define MAX_THREADS 32  /* thread states searched for the sampled thread's */
#define FRAME_OWNED_BY_CSTACK 3

struct control {
	__u32 gen;    /* the generation being filled: 0 or 1 */
	__u32 stacks; /* copy and count stacks */
};

struct key {
	__u32 pid;   /* thread group id (0: the idle task) */
	__u16 event; /* index of the event in the session (the link's cookie) */
	__u16 kernel; /* 1: the sample interrupted kernel code */
	__u64 ip;
	__u64 stack; /* hash of the stack (0: none) */
};

struct val {
	__u64 count;
	__u64 period; /* sum of the samples' periods, in the event's units */
	__u64 last_ns; /* CLOCK_MONOTONIC of the last sample (perf's clock in the session) */
};

/* Timelines: samples per thread per 100 ms window (of CLOCK_MONOTONIC), per event. */
#define WINDOW_NS 100000000ULL
struct tkey {
	__u32 pid;
	__u32 tid;
	__u32 window; /* bpf_ktime_get_ns() / WINDOW_NS */
	__u32 event;
};

struct tval {
	__u64 count;
	__u64 period;
};

struct trace {
	__u32 nkernel; /* bytes of kernel frames (bpf_get_stack's return; 0 when it failed) */
	__u32 nuser;   /* bytes of user frames */
	__u64 ip[MAX_FRAMES]; /* kernel frames from 0, user frames from MAX_KERNEL; zeros after */
	__u32 npy;     /* Python frames */
	__u32 pad;
	__u64 py[2 * MAX_PY]; /* per Python frame: its code object and instruction pointer */
};

/* A CPython 3.11+ process (collect/pyframes.py fills it in): where its interpreter's list of
 * thread states starts, and the offsets of the fields the walk reads, for its version. The
 * sampled thread's state is the one whose native_thread_id is the thread's id; its frames are
 * the chain of _PyInterpreterFrame from the current one, each naming its code object. */
struct py_proc {
	__u64 threads_head;   /* address of interp->threads.head */
	__u32 tstate_next;
	__u32 tstate_tid;     /* native_thread_id */
	__u32 tstate_cframe;  /* cframe (3.11, 3.12); ~0: current_frame is in the thread state (3.13) */
	__u32 current_frame;  /* in _PyCFrame, or in the thread state */
	__u32 frame_code;     /* f_code / f_executable */
	__u32 frame_instr;    /* prev_instr / instr_ptr */
	__u32 frame_previous;
	__u32 frame_owner;
};

/* Counters since load, per CPU: samples seen, samples not counted (their generation's map was
 * full), stacks not kept (the stack map was full), stacks that could not be copied, samples left
 * out of the timeline (its map was full). */
enum { STAT_SAMPLES, STAT_LOST, STAT_LOST_STACKS, STAT_STACK_ERRORS, STAT_LOST_TIMELINE, NSTATS };

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct control);
} control SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, NSTATS);
	__type(key, __u32);
	__type(value, __u64);
} stats SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct trace);
} scratch SEC(".maps");

/* Preallocated (perf_event programs may run in NMI context, where a hash map cannot allocate);
 * user space sets the sizes before loading. */
struct counts_map {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct key);
	__type(value, struct val);
};
struct counts_map counts0 SEC(".maps");
struct counts_map counts1 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, struct py_proc);
} py_procs SEC(".maps");

struct stacks_map {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1);
	__type(key, __u64);
	__type(value, struct trace);
};
struct stacks_map stacks0 SEC(".maps");
struct stacks_map stacks1 SEC(".maps");

struct timeline_map {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, struct tkey);
	__type(value, struct tval);
};
struct timeline_map timeline0 SEC(".maps");
struct timeline_map timeline1 SEC(".maps");

static __always_inline void bump(__u32 which)
{
	__u64 *n = bpf_map_lookup_elem(&stats, &which);
	if (n)
		*n += 1; /* per CPU: no other writer */
}

/* The value under key in a hash map, made from init where there is none (another CPU may make it
 * meanwhile: then its); NULL when the map is full. */
static __always_inline void *value_of(void *map, const void *key, const void *init)
{
	void *v = bpf_map_lookup_elem(map, key);
	if (v)
		return v;
	bpf_map_update_elem(map, key, init, BPF_NOEXIST);
	return bpf_map_lookup_elem(map, key);
}

static __always_inline __u64 read_ptr(__u64 addr)
{
	__u64 v = 0;
	if (bpf_probe_read_user(&v, sizeof(v), (void *)addr))
		return 0;
	return v;
}

/* The walks below run under bpf_loop (5.17): the verifier checks a callback once, where unrolled
 * or bounded loops of reads and branches made it explore millions of states. */
struct thread_walk {
	__u64 ts;
	__u64 tid;
	__u32 next;
	__u32 tid_off;
	int found;
};

static long thread_step(__u32 i, void *data)
{
	struct thread_walk *w = data;
	if (!w->ts)
		return 1;
	if (read_ptr(w->ts + w->tid_off) == w->tid) {
		w->found = 1;
		return 1;
	}
	w->ts = read_ptr(w->ts + w->next);
	return 0;
}

struct frame_walk {
	__u64 frame;
	__u32 n;
	__u32 code;
	__u32 instr;
	__u32 previous;
	__u32 owner;
};

static long frame_step(__u32 i, void *data)
{
	struct frame_walk *w = data;
	__u32 zero = 0;
	if (!w->frame || w->n >= MAX_PY)
		return 1;
	struct trace *t = bpf_map_lookup_elem(&scratch, &zero);
	if (!t)
		return 1;
	__u8 owner = 0;
	bpf_probe_read_user(&owner, 1, (void *)(w->frame + w->owner));
	if (owner != FRAME_OWNED_BY_CSTACK) {
		__u32 j = w->n & (MAX_PY - 1);
		t->py[2 * j] = read_ptr(w->frame + w->code);
		t->py[2 * j + 1] = read_ptr(w->frame + w->instr);
		w->n++;
	}
	w->frame = read_ptr(w->frame + w->previous);
	return 0;
}

/* The sampled thread's Python frames into t->py (zeros after them); their number. */
static __always_inline __u32 python_frames(struct trace *t, __u32 pid, __u32 tid)
{
	for (int i = 0; i < 2 * MAX_PY; i++)
		t->py[i] = 0;
	struct py_proc *pp = bpf_map_lookup_elem(&py_procs, &pid);
	if (!pp)
		return 0;
	struct thread_walk tw = {read_ptr(pp->threads_head), tid, pp->tstate_next, pp->tstate_tid, 0};
	bpf_loop(MAX_THREADS, thread_step, &tw, 0);
	if (!tw.found)
		return 0;
	__u64 base = tw.ts;
	if (pp->tstate_cframe != 0xffffffff)
		base = read_ptr(tw.ts + pp->tstate_cframe);
	if (!base)
		return 0;
	struct frame_walk fw = {read_ptr(base + pp->current_frame), 0, pp->frame_code, pp->frame_instr,
				pp->frame_previous, pp->frame_owner};
	bpf_loop(MAX_PY_WALK, frame_step, &fw, 0);
	return fw.n;
}

static __always_inline __u64 stack_of(struct bpf_perf_event_data *ctx, __u32 gen, __u64 pid_tgid)
{
	__u32 zero = 0;
	struct trace *t = bpf_map_lookup_elem(&scratch, &zero);
	if (!t)
		return 0;
	/* Both calls write their whole area (frames, then zeros; zeros on failure): the hash below
	 * reads no byte of an earlier sample. In user mode the kernel part is empty. */
	long nk = bpf_get_stack(ctx, &t->ip[0], MAX_KERNEL * 8, 0);
	long nu = bpf_get_stack(ctx, &t->ip[MAX_KERNEL], MAX_USER * 8, BPF_F_USER_STACK);
	if (nk < 0)
		nk = 0;
	if (nu < 0)
		nu = 0;
	t->npy = python_frames(t, pid_tgid >> 32, (__u32)pid_tgid);
	t->pad = 0;
	if (nk == 0 && nu == 0 && t->npy == 0) {
		bump(STAT_STACK_ERRORS);
		return 0;
	}
	t->nkernel = nk;
	t->nuser = nu;
	/* FNV-1a over the frames, mixed once more: collisions between two stacks seen in one
	 * generation are about n^2 / 2^65 */
	__u64 h = 0xcbf29ce484222325ULL ^ ((__u64)nk << 32) ^ (__u64)nu;
	for (int i = 0; i < MAX_FRAMES; i++) {
		h ^= t->ip[i];
		h *= 0x100000001b3ULL;
	}
	for (int i = 0; i < 2 * MAX_PY; i++) {
		h ^= t->py[i];
		h *= 0x100000001b3ULL;
	}
	h ^= h >> 33;
	h |= 1; /* 0 means no stack */
	long err = bpf_map_update_elem(gen ? (void *)&stacks1 : (void *)&stacks0, &h, t, BPF_NOEXIST);
	if (err && err != -17 /* EEXIST: seen already in this generation */) {
		bump(STAT_LOST_STACKS);
		return 0;
	}
	return h;
}

SEC("perf_event")
int cyclescope_sample(struct bpf_perf_event_data *ctx)
{
	__u32 zero = 0;
	struct control *c = bpf_map_lookup_elem(&control, &zero);
	if (!c)
		return 0;
	__u32 gen = c->gen & 1;
	bump(STAT_SAMPLES);

	struct key k = {};
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	k.pid = pid_tgid >> 32;
	k.event = bpf_get_attach_cookie(ctx);
	k.kernel = (ctx->regs.cs & 3) == 0;
	k.ip = ctx->regs.rip; /* uapi names (asm/ptrace.h) */
	if (c->stacks)
		k.stack = stack_of(ctx, gen, pid_tgid);

	__u64 period = ctx->sample_period;
	__u64 now = bpf_ktime_get_ns();

	struct tkey tk = {k.pid, (__u32)pid_tgid, (__u32)(now / WINDOW_NS), k.event};
	struct tval tinit = {};
	struct tval *tv = value_of(gen ? (void *)&timeline1 : (void *)&timeline0, &tk, &tinit);
	if (tv) {
		__sync_fetch_and_add(&tv->count, 1);
		__sync_fetch_and_add(&tv->period, period);
	} else {
		bump(STAT_LOST_TIMELINE);
	}

	struct val vinit = {};
	struct val *v = value_of(gen ? (void *)&counts1 : (void *)&counts0, &k, &vinit);
	if (!v) {
		bump(STAT_LOST);
		return 0;
	}
	__sync_fetch_and_add(&v->count, 1);
	__sync_fetch_and_add(&v->period, period);
	if (v->last_ns < now)
		v->last_ns = now;
	return 0;
}

char LICENSE[] SEC("license") = "GPL";
