"""Every reach into a private name of torch, FSDP2 or torchtune, each beside the version it
was written for; ``tests`` hold one check per patch that fails when an upgrade removes it."""
