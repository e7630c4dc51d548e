from cyclescope.cli.main import entry

if __name__ == "__main__":
    entry()
