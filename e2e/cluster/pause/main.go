// The pod sandbox's process for the real node (e2e/cluster/node.py): it holds the pod's
// namespaces until the kubelet stops the pod. Built from this file because registry.k8s.io's
// pause image cannot be pulled here.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signal.Ignore(syscall.SIGCHLD) // as PID 1: exited children are reaped by the kernel
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	<-stop
}
