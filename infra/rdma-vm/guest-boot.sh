#!/bin/sh
# PID 1 of the test guest (baked into the image as /sbin/kdsync-vm-boot).
# Mounts the project (read-only 9p tag "src") and the results folder (tag
# "out"), then runs infra/rdma-vm/guest-init.sh from the project, so editing
# the test flow never needs an image rebuild.  Always powers off at the end.
PATH=/usr/sbin:/usr/bin:/sbin:/bin
export PATH
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev 2>/dev/null
mkdir -p /dev/pts /run /tmp /mnt/src /mnt/out
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /tmp
modprobe 9pnet_virtio 2>/dev/null
modprobe 9p 2>/dev/null
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 src /mnt/src
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 out /mnt/out
if [ -x /mnt/src/infra/rdma-vm/guest-init.sh ] || [ -f /mnt/src/infra/rdma-vm/guest-init.sh ]; then
    sh /mnt/src/infra/rdma-vm/guest-init.sh >/mnt/out/guest.log 2>&1
    echo "kdsync-vm: guest-init exit $?" >/dev/console
else
    echo "kdsync-vm: project not mounted" >/dev/console
fi
sync
umount /mnt/out 2>/dev/null
echo o >/proc/sysrq-trigger 2>/dev/null
# The power-off runs asynchronously; wait for it instead of exiting PID 1.
sleep 30
