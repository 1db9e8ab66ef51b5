module github.com/pvrdma-backend/pvrdma-backend

go 1.26.8

require (
	github.com/coreos/go-systemd/v22 v22.7.0
	github.com/digitalocean/go-qemu v0.0.0-20250212194115-ee9b0668d242
	github.com/stretchr/testify v1.12.1
	github.com/vishvananda/netlink v1.3.1
	github.com/vishvananda/netns v0.0.5
	golang.org/x/sys v0.49.0
)

require (
	github.com/digitalocean/go-libvirt v0.0.0-20220804181439-8648fbde413e // indirect
	go.yaml.in/yaml/v3 v3.0.5 // indirect
)
