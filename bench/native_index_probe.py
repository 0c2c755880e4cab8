#!/usr/bin/env python3
"""What a compiled block index would save a small-block Store and Load: a probe for issue 10's 64 KiB line.

    .venv/bin/python bench/native_index_probe.py [--live 98304] [--batches 32768,2048] [--rounds 5]

The daemon's index is a dict of 32-byte hash (bytes) -> entry per namespace. Per block a Store pays a bytes object
cut from the request's packed hashes, a setdefault (its reservation) and, when it evicts, a pop (the victim's key:
the stored object itself); a Load pays the bytes object and a get (an equal, distinct key object). This compiles
(with the system C compiler, into a temporary directory; nothing is installed) a minimal open-addressing table
with the 32-byte keys inline and PyObject* values, whose batch calls take the packed field as it arrives:
get_many(packed) -> values, setdefault_many(packed, values), pop_many(packed). Both are timed on --live keys per
op, ns a key, best of --rounds. Not the daemon's code: the figure the "compiled core" option of issue 10 starts
from (bench/hash_index_probe.py: a numpy table is slower than the dict). Exits 0 with a note when no compiler.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sysconfig
import tempfile
import time

import numpy as np

C = r'''
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <stdint.h>
typedef struct { uint64_t k[4]; PyObject *v; } Slot;   /* v == NULL: empty; v == TOMB: deleted */
typedef struct { PyObject_HEAD Slot *t; Py_ssize_t cap, used, tombs; } Table;
static PyObject TOMB_OBJ; 
#define TOMB (&TOMB_OBJ)
static int grow(Table *s, Py_ssize_t want);
static Py_ssize_t find(Table *s, const uint64_t *k, int for_insert) {
    size_t mask = s->cap - 1, i = (size_t)(k[1]) & mask; Py_ssize_t first_tomb = -1;
    for (;;) {
        Slot *e = &s->t[i];
        if (e->v == NULL) return for_insert && first_tomb >= 0 ? first_tomb : (for_insert ? (Py_ssize_t)i : -1 - (Py_ssize_t)i);
        if (e->v == TOMB) { if (first_tomb < 0) first_tomb = i; }
        else if (e->k[0] == k[0] && e->k[1] == k[1] && e->k[2] == k[2] && e->k[3] == k[3]) return for_insert ? -2 - (Py_ssize_t)i : (Py_ssize_t)i;
        i = (i + 1) & mask;
    }
}
static int grow(Table *s, Py_ssize_t cap) {
    Slot *old = s->t; Py_ssize_t oc = s->cap;
    s->t = PyMem_Calloc(cap, sizeof(Slot)); if (!s->t) { s->t = old; PyErr_NoMemory(); return -1; }
    s->cap = cap; s->tombs = 0;
    for (Py_ssize_t j = 0; j < oc; j++) if (old[j].v && old[j].v != TOMB) {
        size_t mask = cap - 1, i = (size_t)old[j].k[1] & mask;
        while (s->t[i].v) i = (i + 1) & mask;
        s->t[i] = old[j];
    }
    PyMem_Free(old); return 0;
}
static PyObject *t_get_many(Table *s, PyObject *arg) {  /* packed bytes -> list of value or None */
    Py_buffer b; if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE)) return NULL;
    Py_ssize_t n = b.len / 32; PyObject *out = PyList_New(n);
    const uint64_t *k = b.buf;
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_ssize_t i = find(s, k + 4 * j, 0);
        PyObject *v = i >= 0 ? s->t[i].v : Py_None; Py_INCREF(v); PyList_SET_ITEM(out, j, v);
    }
    PyBuffer_Release(&b); return out;
}
static PyObject *t_setdefault_many(Table *s, PyObject *args) {  /* packed, list of values -> list of present-or-inserted */
    PyObject *arg, *vals; if (!PyArg_ParseTuple(args, "OO", &arg, &vals)) return NULL;
    Py_buffer b; if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE)) return NULL;
    Py_ssize_t n = b.len / 32;
    if ((s->used + s->tombs + n) * 2 > s->cap) { Py_ssize_t c = s->cap; while ((s->used + n) * 4 > c) c *= 2; if (grow(s, c)) { PyBuffer_Release(&b); return NULL; } }
    PyObject *out = PyList_New(n); const uint64_t *k = b.buf;
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_ssize_t i = find(s, k + 4 * j, 1); PyObject *v;
        if (i <= -2) v = s->t[-2 - i].v;
        else { Slot *e = &s->t[i]; if (e->v == TOMB) s->tombs--; memcpy(e->k, k + 4 * j, 32); v = PyList_GET_ITEM(vals, j); Py_INCREF(v); e->v = v; s->used++; }
        Py_INCREF(v); PyList_SET_ITEM(out, j, v);
    }
    PyBuffer_Release(&b); return out;
}
static PyObject *t_pop_many(Table *s, PyObject *arg) {  /* packed -> number removed */
    Py_buffer b; if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE)) return NULL;
    Py_ssize_t n = b.len / 32, gone = 0; const uint64_t *k = b.buf;
    for (Py_ssize_t j = 0; j < n; j++) { Py_ssize_t i = find(s, k + 4 * j, 0);
        if (i >= 0) { Py_DECREF(s->t[i].v); s->t[i].v = TOMB; s->used--; s->tombs++; gone++; } }
    PyBuffer_Release(&b);
    if (s->tombs * 4 > s->cap && grow(s, s->cap)) return NULL;
    return PyLong_FromSsize_t(gone);
}
static int t_init(Table *s, PyObject *a, PyObject *k) { s->cap = 1024; s->used = s->tombs = 0; s->t = PyMem_Calloc(s->cap, sizeof(Slot)); return s->t ? 0 : -1; }
static void t_dealloc(Table *s) { for (Py_ssize_t j = 0; j < s->cap; j++) if (s->t[j].v && s->t[j].v != TOMB) Py_DECREF(s->t[j].v); PyMem_Free(s->t); Py_TYPE(s)->tp_free(s); }
static PyMethodDef methods[] = {{"get_many", (PyCFunction)t_get_many, METH_O, 0}, {"setdefault_many", (PyCFunction)t_setdefault_many, METH_VARARGS, 0}, {"pop_many", (PyCFunction)t_pop_many, METH_O, 0}, {0}};
static PyTypeObject TableType = { PyVarObject_HEAD_INIT(NULL, 0) .tp_name = "cidx.Table", .tp_basicsize = sizeof(Table), .tp_flags = Py_TPFLAGS_DEFAULT, .tp_new = PyType_GenericNew, .tp_init = (initproc)t_init, .tp_dealloc = (destructor)t_dealloc, .tp_methods = methods };
static struct PyModuleDef mod = { PyModuleDef_HEAD_INIT, "cidx", 0, -1, 0 };
PyMODINIT_FUNC PyInit_cidx(void) { if (PyType_Ready(&TableType) < 0) return NULL; PyObject *m = PyModule_Create(&mod); Py_INCREF(&TableType); PyModule_AddObject(m, "Table", (PyObject *)&TableType); return m; }
'''


def build():
    cc = shutil.which("cc") or shutil.which("gcc")
    inc = sysconfig.get_paths()["include"]
    if cc is None or not os.path.exists(os.path.join(inc, "Python.h")):
        return None
    d = tempfile.mkdtemp(prefix="cidx-")
    with open(os.path.join(d, "cidx.c"), "w") as f:
        f.write(C)
    so = os.path.join(d, "cidx" + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-I" + inc, os.path.join(d, "cidx.c"), "-o", so], check=True)
    spec = importlib.util.spec_from_file_location("cidx", so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    shutil.rmtree(d, ignore_errors=True)
    return mod


def split(p: bytes) -> list[bytes]:
    return [p[i:i + 32] for i in range(0, len(p), 32)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--live", type=int, default=98304)
    ap.add_argument("--batches", default="32768,2048")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    cidx = build()
    if cidx is None:
        print("no C compiler or Python.h here: nothing measured")
        return
    rng = np.random.default_rng(1)

    def packed(n: int) -> bytes:
        return rng.integers(0, 2**63, size=(n, 4), dtype=np.int64).tobytes()

    rows = []
    for n in map(int, a.batches.split(",")):
        best: dict[str, float] = {}

        def keep(k: str, s: float) -> None:
            best[k] = min(best.get(k, 1e9), s / n * 1e9)

        live = [packed(n) for _ in range(max(1, a.live // n))]
        d: dict[bytes, object] = {}
        t = cidx.Table()
        stored = []
        for p in live:
            ks = split(p)
            d.update(zip(ks, range(n)))
            stored.append(ks)
            t.setdefault_many(p, list(range(n)))
        for _ in range(a.rounds):
            p, old, old_keys = packed(n), live.pop(0), stored.pop(0)
            vals = [object() for _ in range(n)]
            t0 = time.perf_counter()
            ks = split(p)
            t1 = time.perf_counter()
            for k in old_keys:  # the victims' own key objects (Entry.hash), as the daemon pops them
                d.pop(k, None)
            t2 = time.perf_counter()
            got = list(map(d.setdefault, ks, vals))
            t3 = time.perf_counter()
            wire = split(p)  # a Load's keys: equal, distinct objects
            t4 = time.perf_counter()
            hit = list(map(d.get, wire))
            t5 = time.perf_counter()
            keep("bytes objects cut from the packed field", t1 - t0)
            keep("dict: pop (a victim)", t2 - t1)
            keep("dict: setdefault (a new block)", t3 - t2)
            keep("dict: get (a Load's hit)", t5 - t4)
            t0 = time.perf_counter()
            t.pop_many(old)
            t1 = time.perf_counter()
            got2 = t.setdefault_many(p, vals)
            t2 = time.perf_counter()
            hit2 = t.get_many(p)
            t3 = time.perf_counter()
            assert got == hit == got2 == hit2 == vals
            keep("C: pop_many", t1 - t0)
            keep("C: setdefault_many", t2 - t1)
            keep("C: get_many (hits)", t3 - t2)
            live.append(p)
            stored.append(ks)
        rows.append((n, best))
    print(f"index ops, {a.live} live keys, best of {a.rounds} rounds, ns a key")
    print("| op | " + " | ".join(f"batch {n}" for n, _ in rows) + " |")
    print("| --- |" + " ---: |" * len(rows))
    for name in rows[0][1]:
        print(f"| {name} | " + " | ".join(f"{b[name]:.0f}" for _, b in rows) + " |")
    for n, b in rows:
        store_py = b["bytes objects cut from the packed field"] + b["dict: setdefault (a new block)"] + b["dict: pop (a victim)"]
        load_py = b["bytes objects cut from the packed field"] + b["dict: get (a Load's hit)"]
        store_c = b["C: setdefault_many"] + b["C: pop_many"]
        print(f"batch {n}: evicting Store's index work {store_py:.0f} -> {store_c:.0f} ns a block, "
              f"Load's {load_py:.0f} -> {b['C: get_many (hits)']:.0f}")


if __name__ == "__main__":
    main()
