"""tether's driver (placeholder until the pipeline lands)."""

if __name__ == "__main__":
    print("tether: the distributed pipeline is not built yet; nothing to run (placeholder, exit 0)")
