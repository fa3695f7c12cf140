def should_pack(samples):
    return True
