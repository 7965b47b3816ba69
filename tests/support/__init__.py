"""What the tests share that is not a test: entry points of the processes they start,
configs they launch, modules they name (rewards, code hacks), and the repository's root."""
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
