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
 * Unwinding without frame pointers (with stacks, -g dwarf; built as profile-unwind.bpf.o, with
 * CYCLESCOPE_UNWIND defined: verifying the walk costs about 40 ms of CPU more at every load,
 * which runs without it do not pay): for a process user space has described
 * (uw_slots, uw_procs), the user frames are walked here with unwind rows derived from the images'
 * .eh_frame (images/cfi.py, encoded by collect/bpfunwind.py into uw_rows), as the OpenTelemetry
 * eBPF profiler does: per frame, the mapping holding the pc (a binary search of the process's
 * executable mappings), the row in force there (a binary search of the image's rows), the CFA from
 * rsp or rbp, the return address at CFA - 8, rbp where the row says it was saved. Code in no image
 * described (JIT code named by a perf map) is stepped over by its frame pointer; a walk stops where
 * an image has no row (hand-written assembly), as collect/unwind.py's does. Processes not described
 * (yet) get the kernel's frame-pointer walk.
 *
 * Python (with stacks): for a CPython 3.10+ process user space has described (py_procs), the
 * sampled thread's Python frames are read from the interpreter's memory and kept with the stack:
 * their code objects and instruction pointers (3.10: instruction indexes), which user space names
 * (function, file, line). Where such a process exits before user space has read the code objects of
 * its stacks (a script of a fraction of a second, named at the next drain), the exit tracepoint
 * (cyclescope_exit, below) copies the bytes user space would have read, while the memory is still
 * there.
 *
 * Loop counts (control.lc_event; analysis/loopcount.py): the loop counter reads the registers of a
 * thread's consecutive samples in one loop, which counting here leaves in the kernel. So the
 * program sends user space the samples it needs, through its CPU's BPF output event (lc_out): a
 * sample of that event whose user ip falls in a range user space watches for its process (lc_watch:
 * the procedures whose loops have a counter register, at the process's addresses), with its
 * general registers; and, whatever it is, the next sample of the event on the same CPU (a pair is
 * a thread's two consecutive samples on one CPU, and the counter tallies how many of a loop's
 * samples were followed by one of the same thread in the loop). The rest is counted as before.
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
	__u32 gen;      /* the generation being filled: 0 or 1 */
	__u32 stacks;   /* copy and count stacks */
	__u32 lc_event; /* the event whose watched samples go to lc_out (LC_NONE: none) */
	__u32 lc_every; /* watch during one timeline window (WINDOW_NS) in this many (0, 1: all) */
};

#define LC_NONE 0xffffffff
#define LC_RANGES 16 /* ranges watched per process */
#define LC_WATCHED 1 /* an lc_rec's flags: in a watched range */
#define LC_FOLLOWER 2 /* the CPU's next sample after a watched one */
#define LC_KERNEL 4 /* the sample interrupted kernel code (its registers are left zero) */
struct lc_range {
	__u64 start;
	__u64 end;
};

struct lc_watch {
	__u32 n; /* ranges in use, from r[0] */
	__u32 pad;
	struct lc_range r[LC_RANGES];
};

struct lc_rec {
	__u32 pid;
	__u32 tid;
	__u64 time; /* CLOCK_MONOTONIC, as the counts' last_ns */
	__u64 ip;
	__u64 period;
	__u32 cpu;
	__u16 event;
	__u16 flags;   /* LC_* */
	__u64 regs[16]; /* rax, rbx, rcx, rdx, rsi, rdi, rbp, rsp, r8-r15 (perf/abi.py's GPRS) */
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
	__u32 pid;     /* the sampled process (stacks of two processes are kept apart) */
	__u64 py[2 * MAX_PY]; /* per Python frame: its code object and instruction pointer */
	__u64 zero;    /* only ever written 0 (a value the verifier does not know: user_frames) */
};

/* A CPython 3.10+ process (collect/pyframes.py fills it in): where its interpreter's list of
 * thread states starts, and the offsets of the fields the walk reads, for its version. The
 * sampled thread's state is the one whose native_thread_id is the thread's id (3.10 has none: its
 * thread_id is the pthread_t, the address of glibc's struct pthread, which holds the tid at
 * tid_deref); its frames are the chain of _PyInterpreterFrame (3.10: PyFrameObject) from the
 * current one, each naming its code object. */
#define NO_OFFSET 0xffffffff /* a py_proc field this version has not (pyframes.py's NO_OFFSET) */
struct py_proc {
	__u64 threads_head;   /* address of interp->threads.head */
	__u32 tstate_next;
	__u32 tstate_tid;     /* native_thread_id (3.10: thread_id) */
	__u32 tstate_cframe;  /* cframe (3.11, 3.12); ~0: current_frame is in the thread state */
	__u32 current_frame;  /* in _PyCFrame, or in the thread state */
	__u32 frame_code;     /* f_code / f_executable */
	__u32 frame_instr;    /* prev_instr / instr_ptr (3.10: f_lasti) */
	__u32 frame_previous;
	__u32 frame_owner;    /* ~0: frames have no owner (3.10: every frame is a Python function's) */
	__u32 tid_deref;      /* ~0: tstate_tid holds the tid; else the tid is a u32 at that offset from it */
	__u32 frame_entry;    /* is_entry (3.11); ~0: entries are told by shim frames (3.12+) or are
			       * every frame (3.10) */
	/* What user space reads of a code object (pyframes.py's _code), copied at exit: */
	__u32 code_head;      /* bytes of the code object before its bytecode */
	__u32 code_qualname;  /* co_qualname (3.10: co_name), a str */
	__u32 code_filename;  /* a str */
	__u32 code_linetable; /* a bytes object */
	__u32 unicode_state;  /* a str's state bits (kind: bits 2-4, ascii: bit 6) */
	__u32 unicode_length; /* its length in characters */
	__u32 ascii_size;     /* where an ASCII str's characters start */
	__u32 compact_size;   /* where another compact str's start */
	__u32 bytes_size;     /* a bytes object's size */
	__u32 bytes_sval;     /* where its bytes start */
	__u32 code_firstlineno; /* co_firstlineno: with the field after it, a code object's tag */
	__u32 frame_span;     /* the bytes from a frame's start that hold every field read (at most 128) */
};

/* A code object of an exiting process, as user space reads it: up to four ranges of its memory
 * (the object's head, its qualified name, its file name, its line table), each from addr[i],
 * len[i] bytes (0: not read). Sizes: a name of up to about 180 characters, a path of 440, a line
 * table of 990 bytes (a function of a few hundred lines); longer ones are cut, and user space's
 * reads beyond a range fail as if unmapped (the frame keeps its name without a line, or is left
 * unnamed). */
#define CODE_HEAD 256
#define NAME_CAP 256
#define FILE_CAP 512
#define TABLE_CAP 1024
struct py_ckey {
	__u32 pid;
	__u32 pad;
	__u64 code;
};

struct py_code {
	__u64 addr[4];
	__u32 len[4];
	__u8 code[CODE_HEAD];
	__u8 name[NAME_CAP];
	__u8 file[FILE_CAP];
	__u8 table[TABLE_CAP];
};

/* Counters since load, per CPU: samples seen, samples not counted (their generation's map was
 * full), stacks not kept (the stack map was full), stacks that could not be copied, samples left
 * out of the timeline (its map was full); user stacks walked with unwind rows, their frames, the
 * walks that reached the outermost frame (a row saying so), the frames stepped over by their frame
 * pointer (in no image described), the walks cut short at an image whose rows were still loading,
 * the frames whose row came from uw_cache; Python processes whose code objects were copied at exit,
 * the code objects copied, those that could not be (unreadable, or py_codes full); samples sent to
 * lc_out for loop counts, and those its ring had no room for. */
enum { STAT_SAMPLES, STAT_LOST, STAT_LOST_STACKS, STAT_STACK_ERRORS, STAT_LOST_TIMELINE, STAT_UW_WALKS,
       STAT_UW_FRAMES, STAT_UW_COMPLETE, STAT_UW_FP, STAT_UW_LOADING, STAT_UW_CACHED, STAT_PY_EXITS,
       STAT_PY_CODES, STAT_PY_CODES_LOST, STAT_LC_SENT, STAT_LC_LOST, NSTATS };

/* Unwind rows (collect/bpfunwind.py writes them): each holds from its pc up to the next row's. */
#define UW_MAPS 64 /* executable mappings described per process (a power of two) */
#define UW_STEPS (MAX_USER * 32) /* bpf_loop iterations of one walk: per frame, two binary searches */
#define UW_LOADING 0xffffffff
enum { UW_CFA_NONE, UW_CFA_RSP, UW_CFA_RBP, UW_CFA_PLT, UW_CFA_END };
enum { UW_BP_SAME, UW_BP_SAVED, UW_BP_LOST };

struct uw_row {
	__u32 pc;      /* link-time address (images above 4 GiB are not described) */
	__s32 cfa_off; /* CFA = rsp or rbp + cfa_off; PLT: rsp + cfa_off, plus 8 past the threshold */
	__s16 bp_off;  /* rbp saved at CFA + bp_off (UW_BP_SAVED); PLT: the threshold of (pc & 15) */
	__u8 cfa;      /* UW_CFA_*; END: the outermost frame */
	__u8 bp;       /* UW_BP_* */
};

struct uw_map {
	__u64 start;
	__u64 end;
	__u64 bias;   /* pc - bias: the image's link-time address */
	__u32 first;  /* its rows in uw_rows: [first, first + count); count 0: no rows (first */
	__u32 count;  /* UW_LOADING: not loaded yet) */
};

struct uw_proc {
	__u32 n;   /* mappings, sorted by start */
	__u32 gen; /* a number no other description of any process had (uw_cache's entries of older
		    * descriptions are never looked up again) */
	struct uw_map m[UW_MAPS];
};

/* The row in force at an address, found before: the searches of the mappings and of the rows take
 * about 25 bpf_loop steps a frame, and a profile's stacks repeat their addresses. */
struct uw_ckey {
	__u64 look;
	__u32 slot;
	__u32 gen;
};

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

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32); /* pid */
	__type(value, struct lc_watch);
} lc_watch SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32); /* 1: the last sample of lc_event on this CPU was watched */
} lc_follow SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct lc_rec);
} lc_scratch SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERF_EVENT_ARRAY);
	__uint(key_size, sizeof(__u32));
	__uint(value_size, sizeof(__u32));
} lc_out SEC(".maps");

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

/* Code objects copied at exit (user space takes them at each drain; allocated as they come: the
 * exit tracepoint does not run in NMI context). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 8192);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct py_ckey);
	__type(value, struct py_code);
} py_codes SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct py_code);
} code_scratch SEC(".maps");

/* pid -> slot in uw_procs (an array, whose lookups the verifier inlines: the walk looks its
 * process up at every step). Sizes set by user space before loading (1 without -g dwarf). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} uw_slots SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct uw_proc);
} uw_procs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1 << 14);
	__type(key, struct uw_ckey);
	__type(value, struct uw_row);
} uw_cache SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct uw_row);
} uw_rows SEC(".maps");

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

static __always_inline void bump_by(__u32 which, __u64 by)
{
	__u64 *n = bpf_map_lookup_elem(&stats, &which);
	if (n)
		*n += by; /* per CPU: no other writer */
}

static __always_inline void bump(__u32 which)
{
	bump_by(which, 1);
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
	__u32 deref;
	int found;
};

static long thread_step(__u32 i, void *data)
{
	struct thread_walk *w = data;
	if (!w->ts)
		return 1;
	__u64 id = read_ptr(w->ts + w->tid_off);
	if (w->deref != NO_OFFSET) {
		__u32 tid = 0;
		bpf_probe_read_user(&tid, sizeof(tid), (void *)(id + w->deref));
		id = tid;
	}
	if (id == w->tid) {
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
	__u32 entry;
	__u32 runs;  /* mark the runs (below): the native walk is whole */
	__u32 tag;   /* where the 8 bytes of a code object hashed into its tag are (below) */
	__u32 span;  /* the bytes of a frame that hold the fields read */
};

/* Bit 0 of a kept frame's code object (which is aligned) says that the frame is the outermost of
 * one run of the evaluation loop (an "entry" frame): the native stack has one
 * _PyEval_EvalFrameDefault per such run, and user space puts each run's Python frames at its own
 * (collect/pyframes.py's interleave). Marked only where the native walk reached the outermost
 * frame (unwind rows, to _start): a frame-pointer walk through an interpreter built without frame
 * pointers finds frames of the loop that are not there, and user space keeps none of the native
 * frames beyond the innermost run then. */
#define PY_ENTRY 1ULL

/* Bits 48-63 of a kept frame's code object (user addresses are below 2^47) are a tag of the
 * object: 16 bits of a hash of its first line and the field after it. A code object freed (the
 * start-up's compiled strings, exec) and another made at its address are two code objects to user
 * space, which reads each once per address: without the tag a function of 3.11's was named
 * `<module>:<string>` from a code object that had lived there during start-up. */
#define PY_ADDR ((1ULL << 48) - 1)

static __always_inline __u64 code_tag(__u64 code, __u32 at)
{
	__u64 v = read_ptr(code + at);
	v *= 0x9e3779b97f4a7c15ULL;
	return (v >> 48) << 48;
}

/* A frame's fields are read from one copy of its head (frame_span bytes: 70-71 from 3.11 on, 104 in
 * 3.10), where a read of each field took four to six bpf_probe_read_user calls a frame. */
#define FRAME_BUF 128
struct frame_buf {
	__u8 b[FRAME_BUF];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct frame_buf);
} frame_scratch SEC(".maps");

static __always_inline __u64 frame_u64(const struct frame_buf *f, __u32 off)
{
	if (off > FRAME_BUF - 8)
		return 0;
	return *(const __u64 *)&f->b[off];
}

static __always_inline __u8 frame_u8(const struct frame_buf *f, __u32 off)
{
	return off < FRAME_BUF ? f->b[off & (FRAME_BUF - 1)] : 0;
}

static long frame_step(__u32 i, void *data)
{
	struct frame_walk *w = data;
	__u32 zero = 0;
	if (!w->frame || w->n >= MAX_PY)
		return 1;
	struct trace *t = bpf_map_lookup_elem(&scratch, &zero);
	struct frame_buf *f = bpf_map_lookup_elem(&frame_scratch, &zero);
	if (!t || !f)
		return 1;
	__u32 span = w->span;
	if (span > FRAME_BUF)
		span = FRAME_BUF;
	if (span == 0 || bpf_probe_read_user(f->b, span, (void *)w->frame))
		return 1; /* not a frame that can be read: the walk ends */
	__u8 owner = w->owner != NO_OFFSET ? frame_u8(f, w->owner) : 0;
	if (owner != FRAME_OWNED_BY_CSTACK) {
		__u32 j = w->n & (MAX_PY - 1);
		__u8 entry = 0;
		if (w->runs && w->entry != NO_OFFSET)
			entry = frame_u8(f, w->entry); /* 3.11's is_entry */
		else if (w->runs && w->owner == NO_OFFSET)
			entry = 1; /* 3.10: a run of the loop per frame */
		__u64 code = frame_u64(f, w->code) & PY_ADDR;
		t->py[2 * j] = code | (code ? code_tag(code, w->tag) : 0) | (entry ? PY_ENTRY : 0);
		t->py[2 * j + 1] = frame_u64(f, w->instr);
		w->n++;
	} else if (w->n > 0 && w->runs) {
		/* 3.12+: a run's shim frame lies beyond its outermost frame, the one kept last */
		__u32 j = (w->n - 1) & (MAX_PY - 1);
		t->py[2 * j] |= PY_ENTRY;
	}
	w->frame = frame_u64(f, w->previous);
	return 0;
}

/* The sampled thread's Python frames into t->py (zeros after them); their number. */
static __always_inline __u32 python_frames(struct trace *t, __u32 pid, __u32 tid, __u32 whole)
{
	for (int i = 0; i < 2 * MAX_PY; i++)
		t->py[i] = 0;
	struct py_proc *pp = bpf_map_lookup_elem(&py_procs, &pid);
	if (!pp)
		return 0;
	struct thread_walk tw = {read_ptr(pp->threads_head), tid, pp->tstate_next, pp->tstate_tid, pp->tid_deref, 0};
	bpf_loop(MAX_THREADS, thread_step, &tw, 0);
	if (!tw.found)
		return 0;
	__u64 base = tw.ts;
	if (pp->tstate_cframe != NO_OFFSET)
		base = read_ptr(tw.ts + pp->tstate_cframe);
	if (!base)
		return 0;
	struct frame_walk fw = {read_ptr(base + pp->current_frame), 0, pp->frame_code, pp->frame_instr,
				pp->frame_previous, pp->frame_owner, pp->frame_entry, whole, pp->code_firstlineno,
				pp->frame_span};
	bpf_loop(MAX_PY_WALK, frame_step, &fw, 0);
	return fw.n;
}

#ifdef CYCLESCOPE_UNWIND
/* One walk of the user stack with unwind rows, a step per bpf_loop iteration (the verifier checks
 * the callback once: unrolled searches made the program too complex to load). Per frame: find the
 * mapping of its pc (phase 1, a binary search), then the row in force (phase 2, another), then step
 * to the caller. Code in no image described (JIT code) is stepped over as collect/unwind.py's
 * _jit_step does: a return address into a CPython perf trampoline (known by its code: `call *%rcx`
 * before it, `add $8, %rsp; ret` at it) as the trampoline lays out its frame (`sub $8, %rsp; call
 * *%rcx`: the return address 8 bytes above the callee's CFA, rbp untouched, and not a frame pointer:
 * read as one it can skip frames); other JIT code by its frame pointer where rbp points into the
 * stack at a return address into an image (V8, the JVM, LuaJIT's maps), else as a trampoline. Each
 * guess is taken only if its return address is in an image described (the same search, "probe").
 */
enum { UW_NEW_FRAME, UW_FIND_MAP, UW_FIND_ROW, UW_STEP };
enum { UW_NO_PROBE, UW_PROBE_FP, UW_PROBE_TRAMPOLINE };

struct uw_walk {
	__u64 pc;
	__u64 sp;
	__u64 bp;
	__u64 look;  /* the address searched for: pc, pc - 1 for a return address (inside the call), or
		      * a guessed return address (probe) */
	__u64 vaddr; /* look - the mapping's bias */
	__u64 cand_sp; /* a guessed caller's sp and bp (probe) */
	__u64 cand_bp;
	__u32 slot;
	__u32 n;     /* frames written */
	__u32 phase;
	__u32 probe;
	__u32 lo;
	__u32 hi;
	__u32 first;
	__u32 complete;
	__u32 fp;    /* frames stepped over by frame pointer */
	__u32 loading;
	__u32 unk;   /* 0, which the verifier does not know (below) */
	__u32 pad;
	struct uw_row row; /* the row in force, found (cached or searched): stepped by UW_STEP */
};

/* The caller's frame by the row in force; 0 to stop. */
static __always_inline int uw_row_step(struct uw_walk *w, struct uw_row *r)
{
	__u64 cfa;
	switch (r->cfa) {
	case UW_CFA_RSP:
		cfa = w->sp + (__s64)r->cfa_off;
		break;
	case UW_CFA_RBP:
		if (!w->bp)
			return 0;
		cfa = w->bp + (__s64)r->cfa_off;
		break;
	case UW_CFA_PLT:
		cfa = w->sp + (__s64)r->cfa_off + (((w->look & 15) >= (__u64)r->bp_off) ? 8 : 0);
		break;
	case UW_CFA_END:
		w->complete = 1 + w->unk;
		return 0;
	default:
		return 0; /* no unwind information here (a gap between FDEs), or a rule not followed */
	}
	if (cfa <= w->sp)
		return 0; /* the stack unwinds upwards: anything else is a wrong row or a corrupt stack */
	__u64 ra = read_ptr(cfa - 8);
	if (r->bp == UW_BP_SAVED)
		w->bp = read_ptr(cfa + (__s64)r->bp_off);
	else if (r->bp == UW_BP_LOST)
		w->bp = 0;
	w->sp = cfa;
	w->pc = ra;
	return ra != 0;
}

/* Search the process's mappings for look (phase UW_FIND_MAP). */
static __always_inline void uw_find(struct uw_walk *w, struct uw_proc *p, __u64 look)
{
	w->look = look;
	w->lo = 0;
	w->hi = p->n < UW_MAPS ? p->n : UW_MAPS;
	w->phase = UW_FIND_MAP + w->unk;
}

/* The 7 bytes around a return address into a CPython perf trampoline (collect/unwind.py's
 * TRAMPOLINE_RETURN), from 2 bytes before it, little-endian. */
#define TRAMPOLINE_RETURN 0x00c308c48348d1ffULL
#define TRAMPOLINE_MASK 0x00ffffffffffffffULL

/* Whether the frame's pc, a return address (not the leaf's pc), is into a CPython trampoline. */
static __always_inline int uw_trampoline(struct uw_walk *w)
{
	__u64 code = 0;
	if (w->n < 2 || bpf_probe_read_user(&code, sizeof(code), (void *)(w->pc - 2)))
		return 0;
	return (code & TRAMPOLINE_MASK) == TRAMPOLINE_RETURN;
}

/* Guess the caller of JIT code: in a CPython trampoline as it lays out its frame; elsewhere first
 * by its frame pointer, if rbp may point at a frame. */
static __always_inline void uw_guess(struct uw_walk *w, struct uw_proc *p)
{
	if (!uw_trampoline(w) && w->bp && w->bp >= w->sp && !(w->bp & 7)) {
		w->probe = UW_PROBE_FP + w->unk;
		w->cand_sp = w->bp + 16;
		w->cand_bp = read_ptr(w->bp);
		uw_find(w, p, read_ptr(w->bp + 8));
	} else {
		w->probe = UW_PROBE_TRAMPOLINE + w->unk;
		w->cand_sp = w->sp + 16;
		w->cand_bp = w->bp;
		uw_find(w, p, read_ptr(w->sp + 8));
	}
}

static long uw_step(__u32 i, void *data)
{
	struct uw_walk *w = data;
	__u32 zero = 0;
	struct trace *t = bpf_map_lookup_elem(&scratch, &zero);
	struct uw_proc *p = bpf_map_lookup_elem(&uw_procs, &w->slot);
	if (!t || !p)
		return 1;
	if (w->phase == UW_NEW_FRAME) {
		/* keep the frame's pc, and find its mapping */
		__u32 j = w->n;
		if (j >= MAX_USER || !w->pc)
			return 1;
		t->ip[MAX_KERNEL + j] = w->pc;
		w->n = j + 1;
		struct uw_ckey ck = {j ? w->pc - 1 : w->pc, w->slot, p->gen};
		struct uw_row *c = bpf_map_lookup_elem(&uw_cache, &ck);
		if (c) {
			w->row = *c;
			w->look = ck.look;
			w->phase = UW_STEP + w->unk;
			bump(STAT_UW_CACHED);
			return 0;
		}
		uw_find(w, p, ck.look);
		return 0;
	}
	if (w->phase == UW_STEP) {
		/* one place steps to the caller (the verifier checks it once): the row found */
		w->phase = UW_NEW_FRAME + w->unk;
		return uw_row_step(w, &w->row) ? 0 : 1;
	}
	if (w->phase == UW_FIND_MAP) {
		if (w->lo < w->hi) { /* the last mapping starting at or before look */
			__u32 mid = ((w->lo + w->hi) / 2) & (UW_MAPS - 1);
			if (p->m[mid].start <= w->look)
				w->lo = mid + 1;
			else
				w->hi = mid;
			return 0;
		}
		__u32 k = (w->lo - 1) & (UW_MAPS - 1);
		int found = w->lo > 0 && w->look && w->look < p->m[k].end;
		if (w->probe) {
			/* a guessed return address: taken if it is in an image */
			if (found) {
				w->pc = w->look;
				w->sp = w->cand_sp;
				w->bp = w->cand_bp;
				w->fp += 1 + w->unk;
				w->probe = UW_NO_PROBE + w->unk;
				w->phase = UW_NEW_FRAME + w->unk;
				return 0;
			}
			if (w->probe == UW_PROBE_FP) {
				w->probe = UW_PROBE_TRAMPOLINE + w->unk;
				w->cand_sp = w->sp + 16;
				w->cand_bp = w->bp;
				uw_find(w, p, read_ptr(w->sp + 8));
				return 0;
			}
			return 1;
		}
		if (!found) {
			uw_guess(w, p); /* in no image described: JIT code */
			return 0;
		}
		if (p->m[k].count == 0) { /* an image without unwind rows (none, or not loaded yet) */
			w->loading = (p->m[k].first == UW_LOADING) + w->unk;
			return 1;
		}
		w->vaddr = w->look - p->m[k].bias;
		if (w->vaddr >> 32)
			return 1;
		w->first = p->m[k].first;
		w->lo = p->m[k].first;
		w->hi = p->m[k].first + p->m[k].count;
		w->phase = UW_FIND_ROW + w->unk;
		return 0;
	}
	if (w->lo < w->hi) { /* the last row starting at or before vaddr */
		__u32 mid = (w->lo + w->hi) / 2;
		struct uw_row *r = bpf_map_lookup_elem(&uw_rows, &mid);
		if (!r)
			return 1;
		if ((__u64)r->pc <= w->vaddr)
			w->lo = mid + 1;
		else
			w->hi = mid;
		return 0;
	}
	if (w->lo <= w->first)
		return 1; /* before the image's first row */
	__u32 at = w->lo - 1;
	struct uw_row *r = bpf_map_lookup_elem(&uw_rows, &at);
	if (!r)
		return 1;
	struct uw_ckey ck = {w->look, w->slot, p->gen};
	bpf_map_update_elem(&uw_cache, &ck, r, BPF_ANY);
	w->row = *r;
	w->phase = UW_STEP + w->unk;
	return 0;
}

/* The sampled thread's user frames into t->ip[MAX_KERNEL...] (zeros after them): walked with unwind
 * rows where user space has described the process, else by the kernel with frame pointers; the
 * bytes written, or a negative error. */
static __always_inline long user_frames(struct bpf_perf_event_data *ctx, struct trace *t, __u32 pid, int kernel,
					__u32 *whole)
{
	__u32 *slot = bpf_map_lookup_elem(&uw_slots, &pid);
	if (!slot)
		return bpf_get_stack(ctx, &t->ip[MAX_KERNEL], MAX_USER * 8, BPF_F_USER_STACK);
	for (int i = 0; i < MAX_USER; i++)
		t->ip[MAX_KERNEL + i] = 0;
	struct uw_walk w = {};
	if (kernel) {
		/* in a system call or an interrupt: the user registers saved at the kernel's entry */
		struct pt_regs regs;
		struct pt_regs *user = (struct pt_regs *)bpf_task_pt_regs(bpf_get_current_task_btf());
		if (!user || bpf_probe_read_kernel(&regs, sizeof(regs), user))
			return -1;
		w.pc = regs.rip;
		w.sp = regs.rsp;
		w.bp = regs.rbp;
	} else {
		/* the context's registers are read field by field: the verifier rewrites each load */
		w.pc = ctx->regs.rip;
		w.sp = ctx->regs.rsp;
		w.bp = ctx->regs.rbp;
	}
	w.slot = *slot;
	/* Zero at run time, a value unknown to the verifier (t->zero is only ever written 0): the
	 * walk's counters and phases, constants otherwise, made it check the callback once per
	 * combination of them (160,000 instructions and half a second of CPU at every load; 20,000
	 * and 50 ms so). Every constant stored into the walk's state adds w->unk for that reason. */
	w.unk = t->zero;
	w.n = w.unk;
	w.fp = w.unk;
	w.phase = w.unk;
	w.probe = w.unk;
	w.complete = w.unk;
	w.loading = w.unk;
	bpf_loop(UW_STEPS, uw_step, &w, 0);
	bump(STAT_UW_WALKS);
	bump_by(STAT_UW_FRAMES, w.n);
	bump_by(STAT_UW_COMPLETE, w.complete);
	bump_by(STAT_UW_FP, w.fp);
	bump_by(STAT_UW_LOADING, w.loading);
	*whole = w.complete;
	return (long)w.n * 8;
}
#endif /* CYCLESCOPE_UNWIND */

/* --- Python code objects copied as their process exits -------------------------------------
 *
 * sched_process_exit runs in the exiting task; on recent kernels (6.18 here) before its memory is
 * released, and it says whether the thread group died with it (group_dead). A kernel whose
 * tracepoint has no group_dead refuses the attach (the program reads past its fields), and names
 * go as before; one that runs it after the memory is gone copies nothing (STAT_PY_CODES_LOST).
 * For the last thread of a CPython process described in py_procs, every code object in its
 * stacks of either generation not named by user space yet (which deletes them once named) is copied
 * into py_codes, as the bytes user space would have read from the process (pyframes.py's _code):
 * the object's head, its names and its line table. */
struct exit_args { /* the tracepoint's format (tracefs: events/sched/sched_process_exit/format) */
	__u64 common;
	char comm[16];
	__s32 pid;
	__s32 prio;
	__u8 group_dead;
};

struct capture_walk {
	__u32 pid;
	__u32 gen;   /* the stacks map looked at */
	__u64 hash;  /* the stack being looked at */
	struct py_proc o;
};

/* A str object's head and characters (at least compact_size bytes, as user space reads the head
 * first), at most cap bytes; how many were read (0: none). */
static __always_inline __u32 copy_str(struct capture_walk *w, __u64 addr, __u8 *dst, __u32 cap)
{
	__u32 state = 0;
	__s64 length = 0;
	if (!addr || bpf_probe_read_user(&state, sizeof(state), (void *)(addr + w->o.unicode_state)) ||
	    bpf_probe_read_user(&length, sizeof(length), (void *)(addr + w->o.unicode_length)))
		return 0;
	if (length < 0 || length > 4096)
		return 0;
	__u64 kind = (state >> 2) & 7;
	__u64 n = ((state >> 6) & 1 ? w->o.ascii_size : w->o.compact_size) + (__u64)length * kind;
	if (n < w->o.compact_size)
		n = w->o.compact_size;
	if (n > cap)
		n = cap;
	if (n == 0 || bpf_probe_read_user(dst, n, (void *)addr))
		return 0;
	return n;
}

/* A pointer at ``off`` in a code object's copied head of ``head`` bytes (0 past it). */
static __always_inline __u64 head_u64(const struct py_code *v, __u32 head, __u32 off)
{
	if (off > CODE_HEAD - 8 || off + 8 > head)
		return 0;
	return *(const __u64 *)&v->code[off];
}

static __always_inline void copy_code(struct capture_walk *w, __u64 code)
{
	__u32 zero = 0;
	struct py_ckey k = {w->pid, 0, code};
	if (!code || bpf_map_lookup_elem(&py_codes, &k))
		return;
	struct py_code *v = bpf_map_lookup_elem(&code_scratch, &zero);
	if (!v)
		return;
	__u32 head = w->o.code_head;
	if (head > CODE_HEAD)
		head = CODE_HEAD;
	if (head == 0 || bpf_probe_read_user(v->code, head, (void *)code)) {
		bump(STAT_PY_CODES_LOST);
		return;
	}
	v->addr[0] = code;
	v->len[0] = head;
	/* The object's fields from the head just copied, not read from the process again */
	__u64 name = head_u64(v, head, w->o.code_qualname);
	v->addr[1] = name;
	v->len[1] = copy_str(w, name, v->name, NAME_CAP);
	__u64 file = head_u64(v, head, w->o.code_filename);
	v->addr[2] = file;
	v->len[2] = copy_str(w, file, v->file, FILE_CAP);
	__u64 table = head_u64(v, head, w->o.code_linetable);
	__s64 size = 0;
	__u64 n = 0;
	if (table && !bpf_probe_read_user(&size, sizeof(size), (void *)(table + w->o.bytes_size)) && size >= 0) {
		n = w->o.bytes_sval + (__u64)size;
		if (n > TABLE_CAP)
			n = TABLE_CAP;
		if (n == 0 || bpf_probe_read_user(v->table, n, (void *)table))
			n = 0;
	}
	v->addr[3] = table;
	v->len[3] = n;
	if (bpf_map_update_elem(&py_codes, &k, v, BPF_NOEXIST) == 0)
		bump(STAT_PY_CODES);
	else
		bump(STAT_PY_CODES_LOST);
}

/* Module bodies die young: importlib frees a module's code object once its body has run, and the
 * memory holds other objects within milliseconds, long before a drain reads it. At a sample, the
 * code objects of its frames that are module bodies (first line 1, and the field after it 0: the
 * tag of the value 1) are copied as at exit, once per drain (user space empties py_codes at each),
 * so that user space names them from the copies where the process's memory holds another object. */
#define MODULE_TAG 0x9e37000000000000ULL /* code_tag of the value 1 */

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct capture_walk);
} walk_scratch SEC(".maps");

static long copy_module(__u32 j, void *data)
{
	__u32 zero = 0;
	struct capture_walk *w = bpf_map_lookup_elem(&walk_scratch, &zero);
	struct trace *t = bpf_map_lookup_elem(&scratch, &zero);
	if (!w || !t || j >= t->npy || j >= MAX_PY)
		return 1;
	__u64 f = t->py[(2 * j) & (2 * MAX_PY - 1)];
	if ((f & ~PY_ADDR) == MODULE_TAG)
		copy_code(w, f & PY_ADDR & ~PY_ENTRY);
	return 0;
}

static __always_inline void copy_modules(__u32 pid)
{
	__u32 zero = 0;
	struct py_proc *pp = bpf_map_lookup_elem(&py_procs, &pid);
	struct capture_walk *w = bpf_map_lookup_elem(&walk_scratch, &zero);
	if (!pp || !w)
		return;
	w->pid = pid;
	__builtin_memcpy(&w->o, pp, sizeof(w->o));
	bpf_loop(MAX_PY, copy_module, NULL, 0); /* the walk in walk_scratch: a callback's context must be on the stack */
}

#ifndef CYCLESCOPE_UNWIND
/* The user stack by frame pointers: the kernel's walk (bpf_get_stack), unless the sample is in user
 * mode and rbp cannot be a frame pointer, not pointing into the stack above rsp: code built without
 * frame pointers keeps data there, and the kernel's walk reads at it, a page fault each time it is
 * not mapped (2 us a sample in this VM, three times the rest of the program) for a frame that
 * would be garbage anyway. Then the stack is the sampled pc alone, as the walk's first frame. */
#define FP_STACK_SPAN (64ULL << 20)
static __always_inline long user_fp_frames(struct bpf_perf_event_data *ctx, struct trace *t, int kernel)
{
	__u64 sp = ctx->regs.rsp, fp = ctx->regs.rbp;
	if (kernel || (fp >= sp && fp - sp < FP_STACK_SPAN))
		return bpf_get_stack(ctx, &t->ip[MAX_KERNEL], MAX_USER * 8, BPF_F_USER_STACK);
	for (int i = 1; i < MAX_USER; i++)
		t->ip[MAX_KERNEL + i] = 0;
	t->ip[MAX_KERNEL] = ctx->regs.rip;
	return 8;
}
#endif

static __always_inline __u64 stack_of(struct bpf_perf_event_data *ctx, __u32 gen, __u64 pid_tgid)
{
	__u32 zero = 0;
	struct trace *t = bpf_map_lookup_elem(&scratch, &zero);
	if (!t)
		return 0;
	/* Both areas are written whole (frames, then zeros; zeros on failure): the hash below reads
	 * no byte of an earlier sample. In user mode the kernel part is empty, and zeroed here: the
	 * helper takes 0.2 us to find nothing. */
	int kernel = (ctx->regs.cs & 3) == 0;
	long nk = 0;
	if (kernel)
		nk = bpf_get_stack(ctx, &t->ip[0], MAX_KERNEL * 8, 0);
	else
		for (int i = 0; i < MAX_KERNEL; i++)
			t->ip[i] = 0;
	__u32 whole = 0; /* the user walk reached the outermost frame */
#ifdef CYCLESCOPE_UNWIND
	long nu = user_frames(ctx, t, pid_tgid >> 32, kernel, &whole);
#else
	long nu = user_fp_frames(ctx, t, kernel);
#endif
	if (nk < 0)
		nk = 0;
	if (nu < 0)
		nu = 0;
	t->npy = python_frames(t, pid_tgid >> 32, (__u32)pid_tgid, whole);
	t->pid = pid_tgid >> 32;
	if (t->npy)
		copy_modules(t->pid);
	t->zero = 0;
	if (nk == 0 && nu == 0 && t->npy == 0) {
		bump(STAT_STACK_ERRORS);
		return 0;
	}
	t->nkernel = nk;
	t->nuser = nu;
	/* FNV-1a over the frames, mixed once more: collisions between two stacks seen in one
	 * generation are about n^2 / 2^65 */
	__u64 h = 0xcbf29ce484222325ULL ^ ((__u64)nk << 32) ^ (__u64)nu ^ ((__u64)t->pid << 16);
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

/* A sample for the loop counter (the header comment's "Loop counts"): sent to lc_out when it is of
 * lc_event and in a range lc_watch holds for its process, or follows one such on this CPU. */
static __always_inline void loop_sample(struct bpf_perf_event_data *ctx, const struct control *c,
					const struct key *k, __u64 pid_tgid, __u64 period, __u64 now)
{
	if (k->event != c->lc_event)
		return;
	__u32 zero = 0;
	__u32 *follow = bpf_map_lookup_elem(&lc_follow, &zero);
	if (!follow)
		return;
	__u16 flags = 0;
	if (*follow) {
		flags = LC_FOLLOWER;
		*follow = 0;
	}
	/* Above a rate the loop counter needs, one window in lc_every, evenly spread: its tallies are
	 * ratios (iterations per paired time, followed samples in the loop per followed), which such
	 * windows leave alone unless a program's phases keep time with them. A follower is sent
	 * whatever the window. */
	__u32 every = c->lc_every;
	if (!k->kernel && (every <= 1 || (now / WINDOW_NS) % every == 0)) {
		struct lc_watch *w = bpf_map_lookup_elem(&lc_watch, &k->pid);
		if (w) {
			for (__u32 i = 0; i < LC_RANGES; i++) {
				if (i >= w->n)
					break;
				if (k->ip >= w->r[i].start && k->ip < w->r[i].end) {
					flags |= LC_WATCHED;
					*follow = 1;
					break;
				}
			}
		}
	}
	if (!flags)
		return;
	struct lc_rec *r = bpf_map_lookup_elem(&lc_scratch, &zero);
	if (!r)
		return;
	r->pid = k->pid;
	r->tid = (__u32)pid_tgid;
	r->time = now;
	r->ip = k->ip;
	r->period = period;
	r->cpu = bpf_get_smp_processor_id();
	r->event = k->event;
	r->flags = flags | (k->kernel ? LC_KERNEL : 0);
	if (k->kernel) {
		__builtin_memset(r->regs, 0, sizeof(r->regs));
	} else {
		r->regs[0] = ctx->regs.rax;
		r->regs[1] = ctx->regs.rbx;
		r->regs[2] = ctx->regs.rcx;
		r->regs[3] = ctx->regs.rdx;
		r->regs[4] = ctx->regs.rsi;
		r->regs[5] = ctx->regs.rdi;
		r->regs[6] = ctx->regs.rbp;
		r->regs[7] = ctx->regs.rsp;
		r->regs[8] = ctx->regs.r8;
		r->regs[9] = ctx->regs.r9;
		r->regs[10] = ctx->regs.r10;
		r->regs[11] = ctx->regs.r11;
		r->regs[12] = ctx->regs.r12;
		r->regs[13] = ctx->regs.r13;
		r->regs[14] = ctx->regs.r14;
		r->regs[15] = ctx->regs.r15;
	}
	if (bpf_perf_event_output(ctx, &lc_out, BPF_F_CURRENT_CPU, r, sizeof(*r)))
		bump(STAT_LC_LOST);
	else
		bump(STAT_LC_SENT);
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

	if (c->lc_event != LC_NONE)
		loop_sample(ctx, c, &k, pid_tgid, period, now);

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

static long capture_frame(__u32 j, void *data)
{
	struct capture_walk *w = data;
	struct trace *t = bpf_map_lookup_elem(w->gen ? (void *)&stacks1 : (void *)&stacks0, &w->hash);
	if (!t || j >= t->npy || j >= MAX_PY)
		return 1;
	copy_code(w, t->py[(2 * j) & (2 * MAX_PY - 1)] & PY_ADDR & ~PY_ENTRY);
	return 0;
}

static long capture_stack(void *map, __u64 *key, struct trace *t, struct capture_walk *w)
{
	if (t->pid != w->pid || t->npy == 0)
		return 0;
	w->hash = *key;
	bpf_loop(MAX_PY, capture_frame, w, 0);
	return 0;
}

SEC("tracepoint/sched/sched_process_exit")
int cyclescope_exit(struct exit_args *ctx)
{
	/* Returns 1 always: a tracepoint program's 0 drops the hit for every perf event of the
	 * tracepoint, other tools' included (perf_trace_run_bpf_submit), not only for ours. */
	if (!ctx->group_dead)
		return 1;
	__u32 pid = bpf_get_current_pid_tgid() >> 32;
	struct py_proc *pp = bpf_map_lookup_elem(&py_procs, &pid);
	if (!pp)
		return 1;
	struct capture_walk w = {.pid = pid};
	__builtin_memcpy(&w.o, pp, sizeof(w.o));
	bump(STAT_PY_EXITS);
	w.gen = 0;
	bpf_for_each_map_elem(&stacks0, capture_stack, &w, 0);
	w.gen = 1;
	bpf_for_each_map_elem(&stacks1, capture_stack, &w, 0);
	return 1;
}

char LICENSE[] SEC("license") = "GPL";
