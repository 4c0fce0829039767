#!/usr/bin/env bash
# Run the venv's Python as on an AVX2-only x86-64 CPU (AMD Zen 3: AVX2, FMA, F16C; no AVX-512),
# from any x86-64 host. QEMU's user mode gives the process the CPUID of an EPYC-Milan, so torch,
# oneDNN, MKL and Atom's kernels see no AVX-512 and choose as they would there; a private mount
# namespace shows it a Zen 3 /proc/cpuinfo, where Atom reads the flags its dispatcher goes by.
# Child processes (sys.executable) run the same way. Arguments go to Python:
#   bash scripts/avx2_host.sh -m pytest -q tests/test_linear.py
#   bash scripts/avx2_host.sh -m atom_core.cli env
# An instruction that CPU lacks (AVX-512, say) faults here (SIGILL) as it would there. QEMU
# translates every instruction, many times slower than the CPU: this is for checking what runs,
# never for timing it. The C++ kernels' compiler runs natively.
# Needs root (CI is) for the mount namespace, and Debian's qemu-user, installed if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python3 ]; then
    echo "avx2_host.sh: no .venv/bin/python3 here; set up first: bash scripts/setup.sh" >&2
    exit 1
fi
if ! command -v qemu-x86_64 >/dev/null; then
    apt-get update -qq && apt-get install -y -qq --no-install-recommends qemu-user >/dev/null
fi
model=EPYC-Milan
# the model's features QEMU's translator does not implement (it warns of each): off, so that
# every process starts quietly; none of them is an instruction-set extension the code uses
off=$(qemu-x86_64 -cpu "$model" /bin/true 2>&1 | sed -nE 's/.*\.([a-z0-9-]+) \[bit.*/\1=off/p' | sort -u | paste -sd, -)
cpu="$model${off:+,$off}"

# a Zen 3's flags, as Linux lists them for an EPYC 7763
flags="fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr
sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl nonstop_tsc
cpuid extd_apicid tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe
popcnt aes xsave avx f16c rdrand hypervisor lahf_lm cmp_legacy cr8_legacy abm sse4a misalignsse
3dnowprefetch osvw topoext invpcid_single ssbd ibrs ibpb stibp vmmcall fsgsbase bmi1 avx2 smep
bmi2 erms invpcid rdseed adx smap clflushopt clwb sha_ni xsaveopt xsavec xgetbv1 xsaves clzero
xsaveerptr rdpru wbnoinvd arat umip pku ospke vaes vpclmulqdq rdpid fsrm"
work=$(mktemp -d)
launcher=.venv/bin/python-avx2-host-$$
trap 'rm -rf "$work" "$launcher"' EXIT
sed -E -e "s/^flags[[:space:]]*:.*/flags\t\t: $(echo $flags)/" \
    -e 's/^model name[[:space:]]*:.*/model name\t: AMD EPYC 7763 64-Core Processor/' \
    -e 's/^cpu family[[:space:]]*:.*/cpu family\t: 25/' -e 's/^model[[:space:]]*:.*/model\t\t: 1/' \
    /proc/cpuinfo >"$work/cpuinfo"

# The launcher sits in the venv's bin so that Python, which takes sys.executable from argv[0],
# finds the venv beside it and starts its own children through QEMU too.
cat >"$launcher" <<EOF
#!/bin/sh
exec qemu-x86_64 -cpu $cpu -0 "\$0" "$PWD/.venv/bin/python3" "\$@"
EOF
chmod +x "$launcher"
unshare --mount --propagation private \
    sh -c 'mount --bind "$1" /proc/cpuinfo && shift && exec "$@"' \
    sh "$work/cpuinfo" "$launcher" "$@"
