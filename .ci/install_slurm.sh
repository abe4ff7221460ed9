#!/usr/bin/env bash
# Installs what tests/test_slurm.py needs to run a real single-node SLURM cluster on this machine:
# Debian's slurmctld + slurmd + slurm-client (SLURM 22.05 on Debian 12) and munge, plus
# slurmdbd and mariadb-server for accounting (what makes `sacct`, the SLURM executor plugin's
# default status command, work).
# Idempotent: does nothing when every binary is already there. Needs root (CI runs as root) and
# apt (Debian/Ubuntu). `make test` runs it only as root or under ROOT_TESTS=require (CI);
# `make slurm` and `make test-root` run it.
# It only installs: the test writes /etc/slurm/*.conf, makes a private database and
# starts/stops the daemons itself (no service is started here).
set -euo pipefail

# (sbatch --version would need a slurm.conf already; ask dpkg instead.)
packages=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
installed_versions() { dpkg-query -W -f '${Package} ${Version}  ' "${packages[@]}" 2>/dev/null; }

needed=(slurmctld slurmd sbatch squeue scontrol sacct sacctmgr munged slurmdbd mariadbd mariadb-install-db)
missing=()
for bin in "${needed[@]}"; do
    # munged lives in /usr/sbin, which is not always on a CI PATH.
    command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || missing+=("$bin")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "[install_slurm] already installed: $(installed_versions)"
    exit 0
fi
echo "[install_slurm] missing: ${missing[*]}; installing ${packages[*]}"

if [ "$(id -u)" -ne 0 ]; then
    echo "[install_slurm] ERROR: SLURM is not installed and installing it needs root (apt-get):" \
         "run 'sudo make slurm' once, or 'sudo make test-root' (it installs SLURM, then runs the tests that need root)" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
# Package scripts try to start services; there is no init system here, so tell them not to.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"
    chmod 755 "$policy"
    created_policy=1
fi
trap 'if [ "$created_policy" = 1 ]; then rm -f "$policy"; fi' EXIT

timeout 600 apt-get update -qq
started=$SECONDS
timeout 900 apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null 2>&1 \
    || timeout 900 apt-get install -y --no-install-recommends "${packages[@]}"
for bin in "${needed[@]}"; do
    command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || {
        echo "[install_slurm] ERROR: $bin still missing after apt-get install" >&2
        exit 1
    }
done
echo "[install_slurm] installed in $((SECONDS - started)) s (apt-get update not counted): $(installed_versions)"
