"""The `geoloco` command."""
import sys
def main(argv=None) -> int:
    print("ok")
    return 0
