"""The code sandbox's system-call filter: a seccomp-BPF program, built here, installed by the
sandbox's launchers (``_zygote.py``, ``_jail.py``) in each call's process before its code runs.

The program answers ``EPERM`` to the calls below and lets every other call through. A reward
(a Python program reading stdin, computing, printing; threads and subprocesses included) has
no use for any of them, and each is either a way out of the call or kernel surface that needs
no privilege to reach:

- ``keys``: ``add_key``, ``request_key``, ``keyctl`` -- the kernel keyrings (each call also has
  an anonymous session keyring of its own, so no host key is even possessed there);
- ``processes``: ``ptrace``, ``process_vm_readv``/``writev``, ``kcmp``, ``pidfd_getfd`` --
  another process's memory, registers or descriptors;
- ``kernel``: ``bpf``, ``perf_event_open``, ``userfaultfd``, ``io_uring_setup``/``enter``/
  ``register``, ``personality`` -- interfaces that have carried most unprivileged kernel exploits;
- ``mounts``: ``mount``, ``umount2``, ``pivot_root``, ``chroot``, the new mount API
  (``open_tree``, ``move_mount``, ``fsopen``, ``fsconfig``, ``fsmount``, ``fspick``,
  ``mount_setattr``), ``unshare``, ``setns``, ``name_to_handle_at``, ``open_by_handle_at``;
- ``machine``: ``kexec_load``, ``kexec_file_load``, ``init_module``, ``finit_module``,
  ``delete_module``, ``reboot``, ``swapon``, ``swapoff``, ``acct``, ``quotactl``, ``syslog``,
  ``vhangup``.

The filter first checks ``seccomp_data.arch``: a call made through another ABI (i386's
``int 0x80`` on x86_64, whose numbers differ) kills the process; on x86_64 an x32 call (number
with bit 30 set) gets ``EPERM``. Only x86_64 and aarch64 are known; elsewhere there is no filter
and the sandbox refuses to start. Namespace creation through ``clone`` is not filtered here:
the call has no capabilities and a nested user namespace limit of 0 (``_zygote.py``).
"""

from __future__ import annotations

import platform
import struct

DENIED = {  # class -> names, as documented above
    "keys": ("add_key", "request_key", "keyctl"),
    "processes": ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd"),
    "kernel": (
        "bpf",
        "perf_event_open",
        "userfaultfd",
        "io_uring_setup",
        "io_uring_enter",
        "io_uring_register",
        "personality",
    ),
    "mounts": (
        "mount",
        "umount2",
        "pivot_root",
        "chroot",
        "open_tree",
        "move_mount",
        "fsopen",
        "fsconfig",
        "fsmount",
        "fspick",
        "mount_setattr",
        "unshare",
        "setns",
        "name_to_handle_at",
        "open_by_handle_at",
    ),
    "machine": (
        "kexec_load",
        "kexec_file_load",
        "init_module",
        "finit_module",
        "delete_module",
        "reboot",
        "swapon",
        "swapoff",
        "acct",
        "quotactl",
        "syslog",
        "vhangup",
    ),
}
DENIED_NAMES = tuple(name for names in DENIED.values() for name in names)

ARCHES = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}  # AUDIT_ARCH_* of seccomp_data.arch
X32_BIT = 0x40000000
NUMBERS = {  # name -> (x86_64, aarch64)
    "add_key": (248, 217),
    "request_key": (249, 218),
    "keyctl": (250, 219),
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "kcmp": (312, 272),
    "pidfd_getfd": (438, 438),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "personality": (135, 92),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "chroot": (161, 51),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "mount_setattr": (442, 442),
    "unshare": (272, 97),
    "setns": (308, 268),
    "name_to_handle_at": (303, 264),
    "open_by_handle_at": (304, 265),
    "kexec_load": (246, 104),
    "kexec_file_load": (320, 294),
    "init_module": (175, 105),
    "finit_module": (313, 273),
    "delete_module": (176, 106),
    "reboot": (169, 142),
    "swapon": (167, 224),
    "swapoff": (168, 225),
    "acct": (163, 89),
    "quotactl": (179, 60),
    "syslog": (103, 116),
    "vhangup": (153, 58),
}

# classic BPF opcodes and seccomp return values (linux/filter.h, linux/seccomp.h)
LD_W_ABS, JEQ_K, JGE_K, RET_K = 0x20, 0x15, 0x35, 0x06
RET_KILL_PROCESS, RET_ERRNO, RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
EPERM = 1
OFFSET_NR, OFFSET_ARCH = 0, 4  # fields of struct seccomp_data


def number(name: str, machine: str) -> int:
    """The system call's number on ``machine`` (``x86_64`` or ``aarch64``)."""
    return NUMBERS[name][tuple(ARCHES).index(machine)]


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def program(machine: str | None = None, denied: tuple[str, ...] = DENIED_NAMES) -> bytes | None:
    """The filter for ``machine`` (default: this one) as ``struct sock_filter`` records, or None
    where no filter is known. ``denied``: the calls that get EPERM (every other is allowed)."""
    machine = machine or platform.machine()
    if machine not in ARCHES:
        return None
    nrs = sorted({number(name, machine) for name in denied})
    checks = [(JGE_K, X32_BIT)] * (machine == "x86_64") + [(JEQ_K, nr) for nr in nrs]
    insns = [
        _insn(LD_W_ABS, OFFSET_ARCH),
        _insn(JEQ_K, ARCHES[machine], jt=1),
        _insn(RET_K, RET_KILL_PROCESS),
        _insn(LD_W_ABS, OFFSET_NR),
    ]
    for i, (code, k) in enumerate(checks):
        insns.append(_insn(code, k, jt=len(checks) - i))  # to the EPERM return
    insns += [_insn(RET_K, RET_ALLOW), _insn(RET_K, RET_ERRNO | EPERM)]
    return b"".join(insns)


def launcher_config(denied: tuple[str, ...] = DENIED_NAMES) -> dict:
    """What a launcher needs to confine a call: the filter (hex) and this machine's ``keyctl``
    number (for the new session keyring); ``{}`` where this machine has no filter."""
    prog = program(denied=denied)
    if prog is None:
        return {}
    return {"seccomp": prog.hex(), "keyctl": number("keyctl", platform.machine())}
