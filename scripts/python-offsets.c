/* offsetof() of the CPython fields collect/pyframes.py reads (scripts/python-offsets builds it). */
#define Py_BUILD_CORE 1
#include <Python.h>
#include <stddef.h>
#include "internal/pycore_runtime.h"
#include "internal/pycore_interp.h"
#if PY_VERSION_HEX >= 0x030B0000
#include "internal/pycore_frame.h"
#else
#include "frameobject.h"
#endif
#include "internal/pycore_code.h"
#include <stdio.h>
int main(void) {
    printf("runtime_interpreters_head %zu\n", offsetof(_PyRuntimeState, interpreters.head));
#if PY_VERSION_HEX >= 0x030B0000
    printf("interp_threads_head %zu\n", offsetof(PyInterpreterState, threads.head));
#else
    printf("interp_threads_head %zu\n", offsetof(PyInterpreterState, tstate_head));
#endif
    printf("tstate_next %zu\n", offsetof(PyThreadState, next));
#if PY_VERSION_HEX >= 0x030B0000
    printf("tstate_tid %zu\n", offsetof(PyThreadState, native_thread_id));
#else
    /* 3.10 has no native_thread_id: thread_id is the pthread_t, glibc's struct pthread */
    printf("tstate_tid %zu\n", offsetof(PyThreadState, thread_id));
#endif
#if PY_VERSION_HEX >= 0x030D0000
    printf("tstate_cframe -1\n");
    printf("current_frame %zu\n", offsetof(PyThreadState, current_frame));
    printf("frame_code %zu\n", offsetof(_PyInterpreterFrame, f_executable));
    printf("frame_instr %zu\n", offsetof(_PyInterpreterFrame, instr_ptr));
#elif PY_VERSION_HEX >= 0x030B0000
    printf("tstate_cframe %zu\n", offsetof(PyThreadState, cframe));
    printf("current_frame %zu\n", offsetof(_PyCFrame, current_frame));
    printf("frame_code %zu\n", offsetof(_PyInterpreterFrame, f_code));
    printf("frame_instr %zu\n", offsetof(_PyInterpreterFrame, prev_instr));
#else
    printf("tstate_cframe -1\n");
    printf("current_frame %zu\n", offsetof(PyThreadState, frame));
    printf("frame_code %zu\n", offsetof(PyFrameObject, f_code));
    printf("frame_instr %zu\n", offsetof(PyFrameObject, f_lasti));  /* an int: code units */
#endif
#if PY_VERSION_HEX >= 0x030B0000
    printf("frame_previous %zu\n", offsetof(_PyInterpreterFrame, previous));
    printf("frame_owner %zu\n", offsetof(_PyInterpreterFrame, owner));
#if PY_VERSION_HEX < 0x030C0000
    printf("frame_entry %zu\n", offsetof(_PyInterpreterFrame, is_entry));
#else
    printf("frame_entry -1\n");  /* 3.12+: a run of the evaluation loop ends at a shim frame */
#endif
    printf("code_adaptive %zu\n", offsetof(PyCodeObject, co_code_adaptive));
    printf("code_qualname %zu\n", offsetof(PyCodeObject, co_qualname));
#else
    printf("frame_previous %zu\n", offsetof(PyFrameObject, f_back));
    printf("frame_owner -1\n");
    printf("frame_entry -1\n");  /* 3.10: every frame is a run of the evaluation loop */
    printf("code_adaptive %zu\n", sizeof(PyCodeObject));  /* the head read */
    printf("code_qualname %zu\n", offsetof(PyCodeObject, co_name));
#endif
    printf("code_filename %zu\n", offsetof(PyCodeObject, co_filename));
    printf("code_firstlineno %zu\n", offsetof(PyCodeObject, co_firstlineno));
    printf("code_linetable %zu\n", offsetof(PyCodeObject, co_linetable));
    printf("bytes_size %zu\n", offsetof(PyVarObject, ob_size));
    printf("bytes_sval %zu\n", offsetof(PyBytesObject, ob_sval));
    printf("unicode_state %zu\n", offsetof(PyASCIIObject, state));
    printf("unicode_length %zu\n", offsetof(PyASCIIObject, length));
    printf("ascii_size %zu\n", sizeof(PyASCIIObject));
    printf("compact_size %zu\n", sizeof(PyCompactUnicodeObject));
    return 0;
}
