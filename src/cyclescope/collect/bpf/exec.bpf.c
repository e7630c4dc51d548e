// SPDX-License-Identifier: GPL-2.0
/* Wakes cyclescope's collector when a CPython interpreter is executed (collect/ebpf.py's
 * ExecWaker loads it; collect/pyframes.py's watch_execs reads what it writes).
 *
 * Attached to the sched_process_exec tracepoint, it looks at the file the new program runs from
 * (current->mm->exe_file, its dentry's name): for a script run by its #! line that is the
 * interpreter, and for a symbolic link the file it resolves to. Where that name holds "python"
 * (python3.12, a virtualenv's python resolved to its base interpreter), it writes the process's
 * pid to this CPU's ring of `wake` (a BPF output perf event whose ring wakes the collector at each
 * record). ftrace's filter on the tracepoint's own `filename`, the fallback where this object
 * cannot load, sees only the name as executed: a console script (pip, pytest), a link of
 * another name, are not matched there.
 *
 * Unlike profile.bpf.c this reads kernel structures, so it is relocated by libbpf against the
 * kernel's BTF (CO-RE: the structs below name only the fields read; libbpf finds their offsets in
 * /sys/kernel/btf/vmlinux). A kernel without BTF refuses the object, and the filter is used.
 *
 * It returns 1: a tracepoint program's 0 drops the hit for every perf event of the tracepoint,
 * other tools' included.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>

#define NAME_BYTES 32 /* of the executable's file name: "python" is looked for in them */

/* The kernel's structures, reduced to the fields read (the ___cs suffix is dropped by libbpf when
 * it matches them against the kernel's types). */
struct qstr___cs {
	const unsigned char *name;
} __attribute__((preserve_access_index));
struct dentry___cs {
	struct qstr___cs d_name;
} __attribute__((preserve_access_index));
struct path___cs {
	struct dentry___cs *dentry;
} __attribute__((preserve_access_index));
struct file___cs {
	struct path___cs f_path;
} __attribute__((preserve_access_index));
struct mm_struct___cs {
	struct file___cs *exe_file;
} __attribute__((preserve_access_index));
struct task_struct___cs {
	struct mm_struct___cs *mm;
} __attribute__((preserve_access_index));

struct {
	__uint(type, BPF_MAP_TYPE_PERF_EVENT_ARRAY);
	__uint(key_size, sizeof(__u32));
	__uint(value_size, sizeof(__u32));
} wake SEC(".maps"); /* per CPU: a BPF output event's fd (max_entries: libbpf sets the CPUs') */

SEC("tracepoint/sched/sched_process_exec")
int cyclescope_exec(void *ctx)
{
	struct task_struct___cs *task = (void *)bpf_get_current_task();
	const unsigned char *name = BPF_CORE_READ(task, mm, exe_file, f_path.dentry, d_name.name);
	char buf[NAME_BYTES] = {};

	if (!name || bpf_probe_read_kernel_str(buf, sizeof(buf), name) < 0)
		return 1;
	for (int i = 0; i + 6 <= NAME_BYTES; i++) {
		if (!buf[i])
			break;
		if (buf[i] == 'p' && buf[i + 1] == 'y' && buf[i + 2] == 't' && buf[i + 3] == 'h' &&
		    buf[i + 4] == 'o' && buf[i + 5] == 'n') {
			__u32 pid = bpf_get_current_pid_tgid() >> 32;

			bpf_perf_event_output(ctx, &wake, BPF_F_CURRENT_CPU, &pid, sizeof(pid));
			break;
		}
	}
	return 1;
}

char LICENSE[] SEC("license") = "GPL";
