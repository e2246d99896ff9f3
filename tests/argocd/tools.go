//go:build tools

// Package tools pins the Argo CD build that the GitOps test runs (see build.sh): one binary that
// acts as the application controller, the repo server or the CLI by the name it is called by.
package tools

import (
	_ "github.com/argoproj/argo-cd/v3/cmd"
)
