import sys
print("recipe stub", __name__, sys.argv)
