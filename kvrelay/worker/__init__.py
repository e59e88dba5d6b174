"""What prefill and decode workers share: the front process, rank runtime, protocol."""
