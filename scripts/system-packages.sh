#!/bin/sh
# System packages of the multi-rank tests (tests/multirank): Open MPI (mpirun), a one-node Slurm
# (slurm-wlm, munge) and the PMIx library Slurm's --mpi=pmix loads (libpmix-dev). `make test` runs this first; it installs what is missing with apt-get when it can
# and otherwise says in one line why not (the tests then skip with one line each). Always exits 0.
need=""
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ]; }
have mpirun || need="$need openmpi-bin libopenmpi-dev"
have slurmctld && have slurmd && have sbatch || need="$need slurm-wlm"
have munged || need="$need munge"
# srun --mpi=pmix loads the unversioned libpmix.so, which only the development package ships
ls /usr/lib/*/libpmix.so /usr/lib/*/pmix2/lib/libpmix.so /usr/lib/libpmix.so >/dev/null 2>&1 || need="$need libpmix-dev"
[ -z "$need" ] && exit 0
say() { echo "system-packages: $*" >&2; }
if ! command -v apt-get >/dev/null 2>&1; then
    say "cannot install$need (no apt-get); tests/multirank will skip"; exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
        say "cannot install$need (not root, no password-less sudo); tests/multirank will skip"; exit 0
    fi
fi
say "installing$need"
export DEBIAN_FRONTEND=noninteractive
# shellcheck disable=SC2086
if ! $SUDO apt-get install -y -q $need >/tmp/forge-system-packages.log 2>&1; then
    $SUDO apt-get update -q >>/tmp/forge-system-packages.log 2>&1
    # shellcheck disable=SC2086
    $SUDO apt-get install -y -q $need >>/tmp/forge-system-packages.log 2>&1 \
        || say "apt-get could not install$need (see /tmp/forge-system-packages.log); tests/multirank will skip"
fi
exit 0
