//! Pods: budgets between pods that all run as root, each in its own PID and mount
//! namespace, with the mounts the webhook writes. A pod is modelled as the kubelet makes
//! one from the webhook's patch (`cudabudget-node webhook --review`): its hostPath volumes'
//! sub-paths made as the kubelet makes them, bind-mounted at the mount paths in a mount
//! namespace of its own (`unshare -m`), its processes in a PID namespace of their own
//! (`unshare -pf --mount-proc`), its environment the patched one (the downward API's
//! values filled in). These need root; otherwise each test prints that it is skipped.

mod private_dirs;
