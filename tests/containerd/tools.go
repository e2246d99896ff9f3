//go:build tools

// Package tools pins the container runtime commands this module builds: containerd, ctr and the
// runc shim, runc itself, and crictl (CRI smoke tests).
package tools

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
	_ "github.com/opencontainers/runc"
	_ "sigs.k8s.io/cri-tools/cmd/crictl"
)
