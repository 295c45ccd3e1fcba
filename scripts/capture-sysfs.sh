#!/usr/bin/env bash
# capture-sysfs.sh OUT.tar.xz: records the part of this machine's sysfs/procfs/etc that
# `hbmio doctor` reads, so the doctor can be run on it elsewhere:
#
#   hbmio doctor / --root DIR        (DIR: where the tarball was unpacked with tar -xf)
#
# Use it to attach a machine to a bug report about the doctor, or to add a test fixture
# (tests/data/doctor/). The tarball is laid out like the real tree, paths relative to "/",
# and holds exactly what src/doctor/*.cpp reads, no more:
#
#   sys/bus/pci/devices/*            the links, as they are, to the PCI functions
#   sys/devices/pci*/...             per PCI function: vendor device class numa_node
#                                    {current,max}_link_{speed,width} resource, config (the first
#                                    4096 bytes, or what is readable: 64 bytes unless root), and the
#                                    `driver` link (pci.cpp, gpu.cpp, topology.cpp)
#   sys/class/nvme/*                 transport address subsysnqn state model, namespace names
#   sys/class/nvme-subsystem/*       the subsystem directories (their controller links)
#   sys/class/nvme-fabrics/ctl       presence
#   sys/class/infiniband/*           ports/N/{state,rate,link_layer} (fabric.cpp)
#   sys/class/block, sys/block,      every block device and partition: `partition`, loop/backing_file,
#   sys/dev/block                    md/level, slaves/ (storage.cpp resolves M:m from mountinfo)
#   sys/module/<m>/version           for nvidia_fs nvidia_peermem nvme_fabrics nvme_rdma nvme_tcp
#                                    ib_core mlx5_core mlx5_ib, and mlx_compat's presence (MOFED)
#   sys/kernel/iommu_groups          structure only: group directories and their device links
#   proc/cmdline                     the iommu options
#   proc/self/mountinfo              this shell's mounts (the doctor's PATH -> device lookup)
#   proc/kallsyms                    FILTERED to the p2pdma_pgmap_ops line (empty when the kernel
#                                    lacks PCI P2PDMA); absent when /proc/kallsyms is unreadable
#   proc/driver/nvidia/version, proc/driver/nvidia/gpus/*/numa_status, proc/driver/nvidia-fs/version
#   etc/cufile.json                  if present
#   run/, run/udev/, run/udev/data/  presence only (empty directories), never the udev database
#   capture-info.txt                 when, kernel release, root or not (not read by the doctor)
#
# How: attribute files are copied with `head -c` (sysfs reports 4096 bytes for every file but
# holds less), at most 64 KiB each; unreadable files are skipped silently. Symbolic links are
# recorded, never followed into the trees they point at: each link's target directory is
# created (empty, unless captured itself) so that the doctor's Root::resolve, which
# canonicalises paths under --root, lands inside the tree. sysfs links are relative and are kept
# verbatim; an absolute link (not seen in sysfs) is rewritten relative, because under --root an
# absolute target would leave the tree and resolve on the machine running the doctor.
#
# Runs as root or not; as a user, config space is cut at 64 bytes (ACS then reads as
# "unreadable") and files only root may read are left out. The result is typically 10-100 KB.
set -euo pipefail
export LC_ALL=C

if [[ $# -ne 1 || $1 == -h || $1 == --help ]]; then
  echo "usage: $0 OUT.tar.xz   (records what hbmio doctor reads; see the top of this script)" >&2
  exit 2
fi
out=$1
[[ $out == /* ]] || out=$PWD/$out

stage=$(mktemp -d "${TMPDIR:-/tmp}/hbmio-capture.XXXXXX")
trap 'rm -rf -- "$stage"' EXIT

readonly MAX_BYTES=65536

# copy FILE [LIMIT]: FILE's content (what `head` can read of it) to the same path in the stage.
copy() {
  local src=$1 limit=${2:-$MAX_BYTES}
  [[ -f $src && -r $src ]] || return 0
  mkdir -p "$stage${src%/*}"
  if ! head -c "$limit" -- "$src" >"$stage$src" 2>/dev/null; then
    rm -f -- "$stage$src"
  fi
  return 0
}

# link PATH: records the symbolic link PATH and creates the directory it points to (or copies
# the small file it points to), so the link resolves inside the stage. PATH's parent must be a
# real directory (a canonical path).
link() {
  local path=$1 text target
  [[ -L $path ]] || return 0
  text=$(readlink -- "$path") || return 0
  if [[ $text == /* ]]; then
    text=$(realpath -m -s --relative-to="${path%/*}" -- "$text")
  fi
  mkdir -p "$stage${path%/*}"
  [[ -e $stage$path || -L $stage$path ]] || ln -s -- "$text" "$stage$path"
  target=$(readlink -f -- "$path" 2>/dev/null) || return 0
  case $target in
    /sys/* | /proc/*) ;;
    *) return 0 ;;
  esac
  if [[ -d $target ]]; then
    mkdir -p "$stage$target"
  elif [[ -f $target ]]; then
    copy "$target"
  fi
}

# real PATH: PATH with every link resolved (empty when it does not exist).
real() { readlink -e -- "$1" 2>/dev/null || true; }

# --- PCI functions -----------------------------------------------------------------------------
pci_attributes=(vendor device class numa_node current_link_speed max_link_speed current_link_width max_link_width resource)
mkdir -p "$stage/sys/bus/pci/devices"
for entry in /sys/bus/pci/devices/*; do
  [[ -e $entry ]] || continue
  link "$entry"
  dir=$(real "$entry")
  [[ -n $dir ]] || continue
  for attribute in "${pci_attributes[@]}"; do copy "$dir/$attribute"; done
  copy "$dir/config" 4096
  link "$dir/driver"
  # Old kernels without /sys/class/nvme: the doctor lists these below class 0x0108 functions.
  for sub in nvme misc block; do
    [[ -d $dir/$sub ]] || continue
    for child in "$dir/$sub"/*; do
      [[ -e $child ]] || continue
      if [[ -L $child ]]; then link "$child"; elif [[ -d $child ]]; then mkdir -p "$stage$child"; fi
    done
  done
done

# --- NVMe controllers and subsystems -----------------------------------------------------------
for class in nvme nvme-subsystem nvme-fabrics; do
  [[ -d /sys/class/$class ]] || continue
  mkdir -p "$stage/sys/class/$class"
  for entry in "/sys/class/$class"/*; do
    [[ -e $entry ]] || continue
    link "$entry"
    dir=$(real "$entry")
    [[ -n $dir && -d $dir ]] || continue
    mkdir -p "$stage$dir"
    for attribute in transport address subsysnqn state model; do copy "$dir/$attribute"; done
    # Namespace directories (nvme0n1, nvme0c0n1) and, in a subsystem, its controller links.
    for child in "$dir"/nvme*; do
      [[ -e $child ]] || continue
      if [[ -L $child ]]; then link "$child"; elif [[ -d $child ]]; then mkdir -p "$stage$child"; fi
    done
  done
done

# --- RDMA devices ------------------------------------------------------------------------------
if [[ -d /sys/class/infiniband ]]; then
  mkdir -p "$stage/sys/class/infiniband"
  for entry in /sys/class/infiniband/*; do
    [[ -e $entry ]] || continue
    link "$entry"
    dir=$(real "$entry")
    [[ -n $dir ]] || continue
    for port in "$dir"/ports/*; do
      [[ -d $port ]] || continue
      for attribute in state rate link_layer; do copy "$port/$attribute"; done
    done
  done
fi

# --- Block devices -----------------------------------------------------------------------------
# block_device DIR: what the doctor reads of a disk or partition directory.
block_device() {
  local dir=$1 slave
  mkdir -p "$stage$dir"
  copy "$dir/partition"
  copy "$dir/loop/backing_file"
  copy "$dir/md/level"
  if [[ -d $dir/slaves ]]; then
    mkdir -p "$stage$dir/slaves"
    for slave in "$dir"/slaves/*; do [[ -L $slave ]] && link "$slave"; done
  fi
  return 0
}
for top in /sys/class/block /sys/block /sys/dev/block; do
  [[ -d $top ]] || continue
  mkdir -p "$stage$top"
  for entry in "$top"/*; do
    [[ -e $entry ]] || continue
    link "$entry"
    dir=$(real "$entry")
    [[ -n $dir && -d $dir ]] && block_device "$dir"
  done
done

# --- Modules, IOMMU ----------------------------------------------------------------------------
if [[ -d /sys/module ]]; then
  mkdir -p "$stage/sys/module"
  for module in nvidia_fs nvidia_peermem nvme_fabrics nvme_rdma nvme_tcp ib_core mlx5_core mlx5_ib mlx_compat; do
    [[ -d /sys/module/$module ]] || continue
    mkdir -p "$stage/sys/module/$module"
    copy "/sys/module/$module/version"
  done
fi

if [[ -d /sys/kernel/iommu_groups ]]; then
  mkdir -p "$stage/sys/kernel/iommu_groups"
  for group in /sys/kernel/iommu_groups/*; do
    [[ -d $group ]] || continue
    mkdir -p "$stage$group/devices"
    for device in "$group"/devices/*; do [[ -L $device ]] && link "$device"; done
  done
fi

# --- procfs, /etc, /run ------------------------------------------------------------------------
copy /proc/cmdline
if [[ -r /proc/self/mountinfo ]]; then
  mkdir -p "$stage/proc/self"
  head -c "$MAX_BYTES" /proc/self/mountinfo >"$stage/proc/self/mountinfo" 2>/dev/null || rm -f "$stage/proc/self/mountinfo"
fi
if [[ -r /proc/kallsyms ]] && head -c 1 /proc/kallsyms >/dev/null 2>&1; then
  # The doctor looks for one symbol only; the whole file is megabytes.
  grep -E '[[:space:]]p2pdma_pgmap_ops$' /proc/kallsyms >"$stage/proc/kallsyms" 2>/dev/null || true
fi
copy /proc/driver/nvidia/version
if [[ -d /proc/driver/nvidia/gpus ]]; then
  for gpu in /proc/driver/nvidia/gpus/*; do
    [[ -d $gpu ]] || continue
    mkdir -p "$stage$gpu"
    copy "$gpu/numa_status"
  done
fi
copy /proc/driver/nvidia-fs/version
copy /etc/cufile.json
for dir in /run /run/udev /run/udev/data; do
  [[ -d $dir ]] && mkdir -p "$stage$dir"
done

{
  echo "hbmio scripts/capture-sysfs.sh"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "kernel: $(uname -srm)"
  echo "as root: $([[ $(id -u) -eq 0 ]] && echo yes || echo no)"
} >"$stage/capture-info.txt"

# --- The tarball -------------------------------------------------------------------------------
members=()
for m in capture-info.txt sys proc etc run; do [[ -e $stage/$m ]] && members+=("$m"); done
tar_flags=(--owner=0 --group=0 --numeric-owner)
tar --sort=name -cf /dev/null -C "$stage" capture-info.txt 2>/dev/null && tar_flags+=(--sort=name)
tar "${tar_flags[@]}" -C "$stage" -cf - "${members[@]}" | xz -9 >"$out.tmp"
mv -f -- "$out.tmp" "$out"
echo "$out: $(wc -c <"$out") bytes, $(tar -tJf "$out" | wc -l) entries"
