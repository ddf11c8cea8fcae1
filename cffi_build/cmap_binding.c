/* C side of cpgbroker's libcmap binding: nothing but the library's own calls, plus free()
 * under a name of ours for the strings cmap_get_string allocates.
 */
#include <stdlib.h>
#include <corosync/corotypes.h>
#include <corosync/cmap.h>

/* Bump together with EXPECTED_BINDING_VERSION in src/cpgbroker/corosync/cmap.py whenever this
 * file or the cdef changes, so that a stale compiled module is refused at import. */
#define CMB_BINDING_VERSION 2

static void cmb_free(void *p)
{
    free(p);
}
