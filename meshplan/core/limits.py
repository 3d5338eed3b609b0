"""Limits the file formats share (one place, so a topology file and a schedule agree)."""

#: devices a topology file may describe (nodes x devices per node), and so ranks a schedule may hold
MAX_DEVICES = 65536
